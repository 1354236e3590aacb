"""The three kinds of people who use Sluice through the browser and the
management API, decided in one place:

* platform admin: a staff user; reviews budget requests, watches pools.
* finance auditor: holds ``tenants.audit_all_tenants`` (the "Finance auditors"
  group) and is not staff; reads every tenant's usage, spend and ledger and
  changes nothing, anywhere.
* tenant member: has a Membership in one or more tenants and sees only those.

A user can be a member and an admin; a finance auditor stays read-only even
where they also hold a membership."""

from __future__ import annotations

AUDIT_PERMISSION = "tenants.audit_all_tenants"


def _active(user) -> bool:
    return bool(user is not None and user.is_authenticated and user.is_active)


def user_is_platform_admin(user) -> bool:
    return _active(user) and bool(user.is_staff)


def user_is_finance_auditor(user) -> bool:
    return _active(user) and not user.is_staff and user.has_perm(AUDIT_PERMISSION)


def user_sees_all_tenants(user) -> bool:
    """Admins and finance auditors read every tenant."""
    return user_is_platform_admin(user) or user_is_finance_auditor(user)


def user_may_write(user) -> bool:
    """Finance auditors are read-only everywhere."""
    return _active(user) and not user_is_finance_auditor(user)


def user_role_label(user) -> str:
    if user_is_platform_admin(user):
        return "Platform admin"
    if user_is_finance_auditor(user):
        return "Finance auditor"
    return "Member"
