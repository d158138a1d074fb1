"""Browser dashboards over ``/ws/dashboard/`` (session auth, Origin checked)."""

from __future__ import annotations

import logging
from typing import Any

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from scheduler import events
from scheduler.models import Job

log = logging.getLogger(__name__)


class DashboardConsumer(AsyncJsonWebsocketConsumer):
    """Live updates for one browser tab.

    The client subscribes with ``{"subscribe": "job", "id": N}``; only jobs the
    user may see are accepted. Events arrive per scoped group (``job.<id>``).
    """

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=4401)
            return
        self.groups_joined: set[str] = set()
        await self.accept()

    async def disconnect(self, code: int) -> None:
        for group in getattr(self, "groups_joined", set()):
            await self.channel_layer.group_discard(group, self.channel_name)

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        if not isinstance(content, dict) or content.get("subscribe") != "job":
            await self.send_json({"error": "expected {'subscribe': 'job', 'id': N}"})
            return
        job_id = content.get("id")
        if not isinstance(job_id, int) or not await self._may_see_job(job_id):
            await self.send_json({"error": "no such job"})
            return
        group = events.job_group(job_id)
        await self.channel_layer.group_add(group, self.channel_name)
        self.groups_joined.add(group)
        await self.send_json({"subscribed": group})

    @database_sync_to_async
    def _may_see_job(self, job_id: int) -> bool:
        user = self.scope.get("user")
        if user is None:
            return False
        return Job.objects.visible_to(user).filter(pk=job_id).exists()  # type: ignore[arg-type]

    async def job_status(self, event: dict[str, Any]) -> None:
        await self.send_json(
            {
                "type": "job.status",
                "job_id": event["job_id"],
                "status": event["status"],
                "message": event["message"],
            }
        )
