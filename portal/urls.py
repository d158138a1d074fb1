"""URLs of the web UI (DESIGN.md "Interfaces": keep these paths stable)."""

from __future__ import annotations

from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path

from portal.accounting import views as accounting
from portal.api import pages as api_pages
from portal.directory.views import DirectoryLoginView
from portal.interactive import views as interactive
from portal.notifications import views as notifications
from portal.prometheus import views as prometheus
from portal.terminal import views as terminal
from portal.views import admin_overview, cluster, jobs

urlpatterns = [
    path("", cluster.overview, name="portal-overview"),
    path("queue/", cluster.queue, name="portal-queue"),
    path("nodes/", cluster.node_list, name="portal-nodes"),
    path("nodes/<int:node_id>/", cluster.node_detail, name="portal-node"),
    path("nodes/<int:node_id>/series/", cluster.node_series, name="portal-node-series"),
    path("nodes/<int:node_id>/mode/", cluster.node_mode, name="portal-node-mode"),
    path(
        "nodes/<int:node_id>/gpus/<int:index>/", cluster.gpu_detail, name="portal-gpu"
    ),
    path(
        "nodes/<int:node_id>/gpus/<int:index>/series/",
        cluster.gpu_series,
        name="portal-gpu-series",
    ),
    path("jobs/", jobs.job_list, name="portal-jobs"),
    path("jobs/new/", jobs.job_new, name="portal-job-new"),
    path("jobs/jupyter/", interactive.jupyter_new, name="portal-jupyter-new"),
    path("jobs/<int:job_id>/", jobs.job_detail, name="portal-job"),
    path("jobs/<int:job_id>/series/", jobs.job_series, name="portal-job-series"),
    path("jobs/<int:job_id>/cancel/", jobs.job_cancel, name="portal-job-cancel"),
    path("jobs/terminal/", terminal.terminal_new, name="portal-terminal-new"),
    path("usage/", accounting.usage, name="portal-usage"),
    path("usage/csv/", accounting.usage_csv, name="portal-usage-csv"),
    path("jobs/<int:job_id>/hold/", jobs.job_hold, name="portal-job-hold"),
    path("jobs/<int:job_id>/release/", jobs.job_release, name="portal-job-release"),
    path("notifications/", notifications.preferences, name="notifications"),
    path("notifications/test/", notifications.send_test, name="notifications-test"),
    path("accounts/login/", DirectoryLoginView.as_view(), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("oidc/", include("portal.oidc.urls")),
    # Before the admin's own URLs, which would take every /admin/... path.
    path(
        "admin/overview/",
        admin_overview.admin_overview,
        name="admin-overview",
    ),
    path("admin/", admin.site.urls),
    path("api/v1/", include("portal.api.urls")),
    path("metrics", prometheus.metrics, name="metrics"),
    path("tokens/", api_pages.token_list, name="api-tokens"),
    path(
        "tokens/<int:token_id>/revoke/", api_pages.token_revoke, name="api-token-revoke"
    ),
    path("device/", api_pages.device_login, name="device-login"),
]

# The database unreachable: a 503 page (or JSON), not a 500 (portal/views/errors.py).
handler500 = "portal.views.errors.server_error"
