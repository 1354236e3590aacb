"""Keyset paging, newest first, for the lists a workload's key or its
tenant's pages read (jobs, batches): one index range per page however deep,
and rows created meanwhile never shift what the next page shows."""

from __future__ import annotations

from django.db.models import Q, QuerySet

from gateway.core.errors import bad_request


def newest_first_page(rows: QuerySet, *, scope: QuerySet, after: str, limit: int, noun: str) -> tuple[list, bool]:
    """One page of ``rows`` ordered by (created_at, id) descending, after the
    row ``after`` (the previous page's last id), and whether more follow.
    ``after`` must be in ``scope`` (the caller's own rows), else a 400: it is
    never used to probe other ids."""
    if after:
        cursor = scope.filter(pk=after).values("created_at", "id").first()
        if cursor is None:
            raise bad_request(f"'after' is not one of this workload's {noun}.", param="after", code="invalid_cursor")
        rows = rows.filter(Q(created_at__lt=cursor["created_at"]) | Q(created_at=cursor["created_at"], id__lt=cursor["id"]))
    found = list(rows.order_by("-created_at", "-id")[:limit + 1])
    return found[:limit], len(found) > limit
