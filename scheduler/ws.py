"""What every websocket consumer of the portal needs from Channels and is not given.

``PeerGoneSafe``: a send to a peer that has gone is dropped. When the socket closes
while a consumer handles a message, the server queues ``websocket.disconnect`` and
raises an ``OSError`` for the handler's next send (ASGI says so; uvicorn raises
``ClientDisconnected``). Uncaught, that exception ends the consumer before the
queued disconnect is dispatched, so ``disconnect()`` never runs: an agent's node
stays ``connected``, a dashboard's watch is never dropped, a terminal's agent is
never told its viewer left. Dropping the send lets the disconnect be handled.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asgiref.typing import ASGIReceiveCallable, ASGISendCallable


class PeerGoneSafe:
    """Mixin, first among a consumer's bases: sends after the peer has gone are
    dropped and ``on_peer_gone`` is called once."""

    peer_gone: bool = False

    async def __call__(
        self, scope: Any, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        async def send_or_drop(message: Any) -> None:
            if self.peer_gone:
                return
            try:
                await send(message)
            except OSError:
                self.peer_gone = True
                self.on_peer_gone()

        await super().__call__(scope, receive, send_or_drop)  # type: ignore[misc]

    def on_peer_gone(self) -> None:
        """Called at the first send that failed; the disconnect follows."""
