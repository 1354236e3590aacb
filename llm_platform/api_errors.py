"""DRF-shaped errors for the management API (/api/*): domain and Django
errors become 4xx with field errors, never a 500."""

from __future__ import annotations

from django.core.exceptions import ObjectDoesNotExist, PermissionDenied
from django.core.exceptions import ValidationError as DjangoValidationError
from django.db import DataError
from django.http import Http404
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler

from budgets.errors import Rejected
from budgets.models import AuditImmutable, LedgerImmutable
from llm_platform.degraded import RETRY_AFTER_S, STORE_UNAVAILABLE


def _validation_detail(exc: DjangoValidationError):
    if hasattr(exc, "error_dict"):
        return {field: [str(m) for m in messages] for field, messages in exc.message_dict.items()}
    return {"non_field_errors": [str(m) for m in exc.messages]}


def api_exception_handler(exc, context):
    if isinstance(exc, DjangoValidationError):
        exc = exceptions.ValidationError(_validation_detail(exc))
    elif isinstance(exc, ObjectDoesNotExist):
        exc = exceptions.NotFound()
    elif isinstance(exc, Http404):
        exc = exceptions.NotFound()
    elif isinstance(exc, PermissionDenied):
        exc = exceptions.PermissionDenied()
    elif isinstance(exc, DataError):
        # A value the database cannot hold (a NUL byte, a number out of
        # range) that validation let through: the caller's input, not our fault.
        exc = exceptions.ValidationError({"non_field_errors": ["A value is not valid here."]})
    elif isinstance(exc, (LedgerImmutable, AuditImmutable)):
        return Response({"detail": str(exc), "code": "immutable"}, status=status.HTTP_409_CONFLICT)
    elif isinstance(exc, STORE_UNAVAILABLE):
        response = Response({"detail": "Sluice cannot reach its budget store right now; retry shortly.",
                             "code": "budget_unavailable"}, status=status.HTTP_503_SERVICE_UNAVAILABLE)
        response["Retry-After"] = str(RETRY_AFTER_S)
        return response
    elif isinstance(exc, Rejected):
        response = Response({"detail": exc.message, "code": exc.reason}, status=exc.status)
        if exc.retry_after_ms is not None:
            response["Retry-After"] = str(exc.retry_after_s)
        return response
    return exception_handler(exc, context)
