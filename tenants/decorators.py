"""Role checks for the web UI's views (tenants/roles.py decides the roles)."""

from __future__ import annotations

from functools import wraps

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied

from tenants.roles import user_is_platform_admin, user_sees_all_tenants


def staff_required(view):
    """Platform admins only; anyone else signed in gets 403."""

    @login_required
    @wraps(view)
    def wrapped(request, *args, **kwargs):
        if not user_is_platform_admin(request.user):
            raise PermissionDenied("Platform admins only.")
        return view(request, *args, **kwargs)

    return wrapped


def auditor_required(view):
    """Platform admins and finance auditors."""

    @login_required
    @wraps(view)
    def wrapped(request, *args, **kwargs):
        if not user_sees_all_tenants(request.user):
            raise PermissionDenied("Finance auditors and platform admins only.")
        return view(request, *args, **kwargs)

    return wrapped
