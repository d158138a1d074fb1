"""Accounts from the lab's directory: LDAP sign-in (``ldap``), the identity a
directory or identity provider gives (``identity``: applied to a user's groups,
staff flag and Unix account, or their removal), the mapping settings
(``mapping``) and the periodic refresh (``tasks``)."""
