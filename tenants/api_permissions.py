"""Role rules of the management API (the same as the web UI's)."""

from __future__ import annotations

from rest_framework.permissions import SAFE_METHODS, BasePermission

from tenants.roles import user_is_platform_admin, user_may_write, user_sees_all_tenants


class ReadOnlyForFinance(BasePermission):
    """Finance auditors may only read."""

    message = "Finance auditors have read-only access."

    def has_permission(self, request, view) -> bool:
        return request.method in SAFE_METHODS or user_may_write(request.user)


class IsPlatformAdmin(BasePermission):
    message = "Platform admins only."

    def has_permission(self, request, view) -> bool:
        return user_is_platform_admin(request.user)


class IsAuditor(BasePermission):
    """Platform admins and finance auditors."""

    message = "Finance auditors and platform admins only."

    def has_permission(self, request, view) -> bool:
        return user_sees_all_tenants(request.user)
