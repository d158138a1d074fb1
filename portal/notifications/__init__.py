"""Notifications: email and a signed webhook per user, sent from an outbox.

Public API: ``portal.notifications.services.notify(user, kind, subject, text,
payload)``. See docs/architecture.md, "Notifications".
"""
