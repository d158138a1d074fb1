"""The Prometheus export: ``/metrics`` in Prometheus' text format.

Every figure is read at scrape time from PostgreSQL and Redis by one custom
collector (``collector.GpulabCollector``) in a registry made for the scrape, so
any web process answers with the same view as the others (no per-process
counters, no multiprocess mode). ``views.metrics`` checks the access settings
(``portal/settings_metrics.py``: a bearer token and/or an address allow-list;
neither set: the export is off). docs/admin-guide.md, "Prometheus and Grafana",
lists the metrics, their labels and their cardinality.
"""
