"""The admin console's registrations of the scheduler's models, one module per
domain (the same split as ``scheduler.models``). Django's admin autodiscovery
imports ``portal.admin`` (the ``portal`` app's ``admin`` module); importing the
modules here registers every model admin with ``admin.site``, the
``portal.admin_site.GpulabAdminSite`` that ``portal.apps.GpulabAdminConfig``
installs.

The console's own pages outside the admin site (the overview) live in
``portal.views``; ``portal.admin_site`` holds the site and its staff-only rule.
"""

from portal.admin import accounts, interference, jobs, nodes, usage

__all__ = ["accounts", "interference", "jobs", "nodes", "usage"]
