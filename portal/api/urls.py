"""``/api/v1/`` (DESIGN.md "Interfaces"): jobs, arrays, nodes, queue, usage; the
OpenAPI schema at ``/api/v1/schema/`` and its browsable docs at ``/api/v1/docs/``."""

from __future__ import annotations

from django.urls import path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView
from rest_framework.permissions import AllowAny

from portal.api import device
from portal.api.views import cluster, jobs

urlpatterns = [
    path("jobs/", jobs.JobList.as_view(), name="api-jobs"),
    path("jobs/<int:job_id>/", jobs.JobDetail.as_view(), name="api-job"),
    path("jobs/<int:job_id>/cancel/", jobs.JobCancel.as_view(), name="api-job-cancel"),
    path("jobs/<int:job_id>/hold/", jobs.JobHold.as_view(), name="api-job-hold"),
    path(
        "jobs/<int:job_id>/release/", jobs.JobRelease.as_view(), name="api-job-release"
    ),
    path(
        "jobs/<int:job_id>/requeue/", jobs.JobRequeue.as_view(), name="api-job-requeue"
    ),
    path("jobs/<int:job_id>/logs/", jobs.JobLogs.as_view(), name="api-job-logs"),
    path("jobs/<int:job_id>/events/", jobs.JobEvents.as_view(), name="api-job-events"),
    path("arrays/", jobs.ArrayList.as_view(), name="api-arrays"),
    path("arrays/<int:array_id>/", jobs.ArrayDetail.as_view(), name="api-array"),
    path(
        "arrays/<int:array_id>/cancel/",
        jobs.ArrayCancel.as_view(),
        name="api-array-cancel",
    ),
    path("nodes/", cluster.NodeList.as_view(), name="api-nodes"),
    path("nodes/<int:node_id>/", cluster.NodeDetail.as_view(), name="api-node"),
    path(
        "nodes/<int:node_id>/drain/", cluster.NodeDrain.as_view(), name="api-node-drain"
    ),
    path(
        "nodes/<int:node_id>/maintenance/",
        cluster.NodeMaintenance.as_view(),
        name="api-node-maintenance",
    ),
    path(
        "nodes/<int:node_id>/resume/",
        cluster.NodeResume.as_view(),
        name="api-node-resume",
    ),
    path("queue/", cluster.Queue.as_view(), name="api-queue"),
    path("usage/", cluster.Usage.as_view(), name="api-usage"),
    path("me/", cluster.Me.as_view(), name="api-me"),
    # gpulab login through the browser (RFC 8628): no token needed
    path("device/code/", device.DeviceCode.as_view(), name="api-device-code"),
    path("device/token/", device.DeviceToken.as_view(), name="api-device-token"),
    path(
        "schema/",
        # public: the schema says what exists, never whose data
        SpectacularAPIView.as_view(throttle_classes=[], permission_classes=[AllowAny]),
        name="api-schema",
    ),
    path(
        "docs/",
        # GET and HEAD only: the page has no metadata for OPTIONS to render
        # (its HTML renderer has no template for OPTIONS: it would answer 500)
        SpectacularSwaggerView.as_view(
            url_name="api-schema",
            permission_classes=[AllowAny],
            http_method_names=["get", "head"],
        ),
        name="api-docs",
    ),
]
