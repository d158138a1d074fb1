"""The user sees their quotas on the jobs list, and on a held job's page why it
waits."""

from __future__ import annotations

from datetime import timedelta
from typing import Any
from unittest import mock

import pytest
from django.test import Client
from django.utils import timezone

from portal.quotas import alerts
from scheduler import pass_runner
from tests.factories import JobFactory
from tests.portal.quotas.helpers import quota, run

pytestmark = pytest.mark.django_db


def page(user: Any, url: str = "/jobs/") -> str:
    client = Client()
    client.force_login(user)
    r = client.get(url)
    assert r.status_code == 200
    return r.content.decode()


def test_the_jobs_list_shows_my_quotas_and_not_others(
    cluster: Any, alice: Any, charlie: Any, groups: Any
) -> None:
    vision = quota(group=groups["vision"], gpu_hours=10, max_gpus=4)
    mine = quota(user=alice, gpu_hours=3, hard=False)
    nlp = quota(group=groups["nlp"], gpu_hours=99)
    run(alice, cluster[0], timezone.now() - 4 * timedelta(hours=1), gpus=1)

    html = page(alice)
    assert f'data-testid="quota-{vision.pk}"' in html
    assert f'data-testid="quota-{mine.pk}"' in html
    assert f'data-testid="quota-{nlp.pk}"' not in html
    assert "4.0 of 10.0" in html  # running job counted live
    assert "1 of 4" in html  # GPUs held / cap
    assert "used up: lower priority" in html  # alice's soft quota: 4.0 of 3.0

    other = page(charlie)
    assert f'data-testid="quota-{nlp.pk}"' in other
    assert f'data-testid="quota-{vision.pk}"' not in other


def test_no_panel_without_quotas(alice: Any) -> None:
    assert 'data-testid="quota-panel"' not in page(alice)


def test_a_held_job_page_says_quota_exhausted(
    cluster: Any, alice: Any, groups: Any
) -> None:
    quota(group=groups["vision"], gpu_hours=0)
    job = JobFactory(owner=alice)
    with mock.patch.object(alerts, "on_alert", autospec=True):
        pass_runner.run_one_pass()
    html = page(alice, f"/jobs/{job.pk}/")
    assert "quota exhausted: group vision used 0.0 of its 0.0 GPU-hours this month" in (
        html
    )
