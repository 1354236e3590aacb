"""The request log: every ledger row and every sampled rejection, newest
first, filtered, paged by keyset.

Keyset, not OFFSET: a page is ``WHERE (created_at, id) < cursor ORDER BY
created_at DESC, id DESC LIMIT n`` on an index that ends in (created_at, id)
(``UsageRecord.Meta.indexes``), so page 10,000 costs what page 1 does and a
row written meanwhile never shifts a page. Rejections (``RejectionSample``,
plus the samples still pending in Redis) merge into the same order: at one
instant ledger rows sort before rejections, ties broken by id (ledger) or
sample id (rejections), so a cursor names one exact place in the merged
sequence.

The scope is the caller's: ``LogFilters.tenant_ids`` (None only for admins
and finance, who read every tenant); a request's own page is reached only
through ``log_entry_of_tenants`` with the same scope (404, never 403)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta, timezone as dt_timezone
from decimal import Decimal

from django.db.models import Q

from tenants.models import ApiKey, Workload
from tenants.text_numbers import ascii_int

from budgets.ledger.rejections import NO_POOL, rejection_by_request_id, rejections_pending
from budgets.models import InferencePool, RejectionSample, UsageRecord

PAGE_SIZE = 50
LEDGER, REJECTION = 1, 0  # rank at one instant: ledger rows first
REJECTED = "rejected"  # the status filter that shows rejections only
# Latency columns a ledger row carries, in the order pages show them. One
# more timing (a stream's time to first token) is one more entry here.
TIMINGS = ("queue_wait_ms", "upstream_ms", "ttft_ms", "total_ms")
TIMING_LABELS = {"queue_wait_ms": "queue wait", "upstream_ms": "upstream", "ttft_ms": "TTFT (streams)",
                 "total_ms": "total"}


@dataclass(frozen=True)
class LogFilters:
    start: datetime
    end: datetime
    tenant_ids: frozenset[int] | None = None  # the caller's scope; None = every tenant
    workload_id: int | None = None
    api_key_id: int | None = None
    status: str | None = None  # a ledger status, or REJECTED
    reason: str | None = None  # a rejection reason (rejections only)
    lane: str | None = None
    model: str | None = None
    endpoint: str | None = None  # a /v1 path (UsageRecord.ENDPOINT_LABELS)

    @property
    def wants_ledger(self) -> bool:
        return self.status != REJECTED and not self.reason

    @property
    def wants_rejections(self) -> bool:
        # Rejections have no lane or model (refused before any was chosen),
        # and their samples do not record the endpoint.
        return self.status in (None, "", REJECTED) and not self.lane and not self.model and not self.endpoint

    def ledger_q(self) -> Q:
        q = Q(created_at__gte=self.start, created_at__lt=self.end)
        if self.tenant_ids is not None:
            q &= Q(tenant_id__in=self.tenant_ids)
        if self.workload_id is not None:
            q &= Q(workload_id=self.workload_id)
        if self.api_key_id is not None:
            q &= Q(api_key_id=self.api_key_id)
        if self.status:
            q &= Q(status=self.status)
        if self.lane:
            q &= Q(lane=self.lane)
        if self.model:
            q &= Q(model=self.model)
        if self.endpoint:
            q &= Q(endpoint=self.endpoint)
        return q

    def rejection_q(self) -> Q:
        q = Q(at__gte=self.start, at__lt=self.end)
        if self.tenant_ids is not None:
            q &= Q(tenant_id__in=self.tenant_ids)
        if self.workload_id is not None:
            q &= Q(workload_id=self.workload_id)
        if self.reason:
            q &= Q(reason=self.reason)
        if self.api_key_id is not None:
            q &= Q(api_key_id=self.api_key_id)
        return q


@dataclass(frozen=True)
class Cursor:
    """A place in the merged order: entries strictly after it come next."""

    at: datetime
    kind: int
    tiebreak: str  # ledger: the row id; rejection: the sample id

    def encode(self) -> str:
        micros = int(self.at.timestamp()) * 1_000_000 + self.at.microsecond
        return f"{micros}.{self.kind}.{self.tiebreak}"

    @classmethod
    def decode(cls, raw: str) -> Cursor | None:
        """None for anything malformed (the page then starts at the top).
        Numbers are ASCII digits only (tenants/text_numbers.py)."""
        micros, _, rest = raw.partition(".")
        kind, _, tiebreak = rest.partition(".")
        micros_n, kind_n = ascii_int(micros), ascii_int(kind, max_digits=1)
        if micros_n is None or kind_n not in (LEDGER, REJECTION) or not tiebreak or len(tiebreak) > 64:
            return None
        if kind_n == LEDGER and ascii_int(tiebreak) is None:
            return None
        seconds, micro = divmod(micros_n, 1_000_000)
        try:
            at = datetime.fromtimestamp(seconds, tz=dt_timezone.utc).replace(microsecond=micro)
        except (ValueError, OverflowError, OSError):
            return None
        return cls(at=at, kind=kind_n, tiebreak=tiebreak)


@dataclass(frozen=True)
class LogEntry:
    kind: int
    at: datetime
    tiebreak: str
    request_id: str  # the ledger's request id; a rejection's sample id
    tenant_id: int
    workload_id: int
    workload_slug: str
    status: str  # a ledger status, or "rejected"
    reason: str  # why it was rejected or failed ("" for a completed request)
    estimated_tokens: int
    actual_tokens: int | None  # None for a rejection (nothing ran)
    cost: Decimal | None
    currency: str
    key_prefix: str
    lane: str
    model: str
    borrowed: bool
    timings: dict[str, int | None]
    retry_after_ms: int | None = None
    pool_slug: str = ""  # the pool that served it ('' for a rejection)
    route: str = ""  # "spilled over", "failed over" or "" (routing across pools)
    endpoint: str = ""  # the /v1 endpoint it came through ('' for a rejection)

    @property
    def is_rejection(self) -> bool:
        return self.kind == REJECTION

    @property
    def cursor(self) -> Cursor:
        return Cursor(at=self.at, kind=self.kind, tiebreak=self.tiebreak)

    @property
    def sort_key(self) -> tuple:
        # Descending order of (at, kind, tiebreak); ledger ids compare as numbers.
        tiebreak = (int(self.tiebreak), "") if self.kind == LEDGER else (0, self.tiebreak)
        return (self.at, self.kind, tiebreak)


@dataclass(frozen=True)
class LogPage:
    entries: list[LogEntry]
    next_cursor: str | None


def _after_ledger(cursor: Cursor) -> Q:
    if cursor.kind == LEDGER:
        return Q(created_at__lt=cursor.at) | Q(created_at=cursor.at, id__lt=int(cursor.tiebreak))
    return Q(created_at__lt=cursor.at)  # ledger rows at that instant came before the rejection


def _after_rejection(cursor: Cursor) -> Q:
    if cursor.kind == LEDGER:
        return Q(at__lte=cursor.at)
    return Q(at__lt=cursor.at) | Q(at=cursor.at, sample_id__lt=cursor.tiebreak)


def ledger_entry_of(row: UsageRecord) -> LogEntry:
    price = row.price
    return LogEntry(
        kind=LEDGER, at=row.created_at, tiebreak=str(row.id), request_id=row.request_id, tenant_id=row.tenant_id,
        workload_id=row.workload_id, workload_slug=row.workload.slug, status=row.status,
        reason="" if row.status == UsageRecord.Status.OK else row.status,
        estimated_tokens=row.estimated_input_tokens + row.estimated_output_tokens,
        actual_tokens=row.actual_input_tokens + row.actual_output_tokens, cost=row.cost,
        currency=price.currency if price is not None else "", key_prefix=row.api_key.prefix if row.api_key else "",
        lane=row.lane, model=row.model, borrowed=row.borrowed,
        timings={name: getattr(row, name, None) for name in TIMINGS},
        pool_slug=row.pool.slug, route=route_label(row), endpoint=row.endpoint,
    )


def route_label(row: UsageRecord) -> str:
    """How the request came to its pool: moved after a failed call, spilled
    over to an overflow slice, or '' (its route's first choice)."""
    if row.failed_over:
        return "failed over"
    return "spilled over" if row.overflow else ""


def _rejection_entry(*, at: datetime, sample_id: str, tenant_id: int, workload_id: int, workload_slug: str,
                     reason: str, estimated_tokens: int, retry_after_ms: int | None, key_prefix: str = "") -> LogEntry:
    return LogEntry(
        kind=REJECTION, at=at, tiebreak=sample_id, request_id=sample_id, tenant_id=tenant_id,
        workload_id=workload_id, workload_slug=workload_slug, status=REJECTED, reason=reason,
        estimated_tokens=estimated_tokens, actual_tokens=None, cost=None, currency="", key_prefix=key_prefix, lane="",
        model="", borrowed=False, timings={name: None for name in TIMINGS}, retry_after_ms=retry_after_ms,
    )


def _pending_rejections(filters: LogFilters, cursor: Cursor | None) -> list[LogEntry]:
    """Samples of minutes not yet flushed (Redis), under the same filters."""
    workload_ids = None
    if filters.tenant_ids is not None:
        workload_ids = set(Workload.objects.filter(tenant_id__in=filters.tenant_ids).values_list("id", flat=True))
    if filters.workload_id is not None:
        workload_ids = {filters.workload_id} & workload_ids if workload_ids is not None else {filters.workload_id}
    if workload_ids is not None and not workload_ids:
        return []
    pool_ids = [NO_POOL, *InferencePool.objects.values_list("id", flat=True)]
    pending = rejections_pending(pool_ids=pool_ids, since=filters.start, workload_ids=workload_ids)
    slugs = dict(Workload.objects.filter(pk__in={d["wid"] for d in pending.samples}).values_list("id", "slug"))
    prefixes = dict(ApiKey.objects.filter(pk__in={d.get("kid") for d in pending.samples if d.get("kid")})
                    .values_list("id", "prefix"))
    out = []
    for data in pending.samples:
        at = datetime.fromtimestamp(float(data["at"]), tz=dt_timezone.utc)
        if not filters.start <= at < filters.end or (filters.reason and data["reason"] != filters.reason):
            continue
        if filters.tenant_ids is not None and data.get("tid") not in filters.tenant_ids:
            continue
        if filters.api_key_id is not None and data.get("kid") != filters.api_key_id:
            continue
        entry = _rejection_entry(at=at, sample_id=data["id"], tenant_id=data["tid"], workload_id=data["wid"],
                                 workload_slug=slugs.get(data["wid"], str(data["wid"])), reason=data["reason"],
                                 estimated_tokens=int(data.get("tokens") or 0),
                                 retry_after_ms=data.get("retry_after_ms"), key_prefix=prefixes.get(data.get("kid"), ""))
        if cursor is None or entry.sort_key < cursor_sort_key(cursor):
            out.append(entry)
    return out


def cursor_sort_key(cursor: Cursor) -> tuple:
    tiebreak = (int(cursor.tiebreak), "") if cursor.kind == LEDGER else (0, cursor.tiebreak)
    return (cursor.at, cursor.kind, tiebreak)


def request_log_page(*, filters: LogFilters, cursor: Cursor | None = None, size: int = PAGE_SIZE) -> LogPage:
    """One page of the log after ``cursor`` (None: the newest)."""
    candidates: list[LogEntry] = []
    if filters.wants_ledger:
        rows = UsageRecord.objects.filter(filters.ledger_q())
        if cursor is not None:
            rows = rows.filter(_after_ledger(cursor))
        rows = rows.select_related("workload", "api_key", "price").order_by("-created_at", "-id")[: size + 1]
        candidates.extend(ledger_entry_of(row) for row in rows)
    if filters.wants_rejections:
        samples = RejectionSample.objects.filter(filters.rejection_q())
        if cursor is not None:
            samples = samples.filter(_after_rejection(cursor))
        seen = set()
        for sample in samples.select_related("workload", "api_key").order_by("-at", "-sample_id")[: size + 1]:
            seen.add(sample.sample_id)
            candidates.append(_rejection_entry(
                at=sample.at, sample_id=sample.sample_id, tenant_id=sample.tenant_id, workload_id=sample.workload_id,
                workload_slug=sample.workload.slug, reason=sample.reason, estimated_tokens=sample.estimated_tokens,
                retry_after_ms=sample.retry_after_ms, key_prefix=sample.api_key.prefix if sample.api_key else ""))
        candidates.extend(e for e in _pending_rejections(filters, cursor) if e.tiebreak not in seen)
    candidates.sort(key=lambda e: e.sort_key, reverse=True)
    page = candidates[:size]
    more = len(candidates) > size
    return LogPage(entries=page, next_cursor=page[-1].cursor.encode() if more and page else None)


@dataclass(frozen=True)
class LedgerDetail:
    entry: LogEntry
    row: UsageRecord
    timeline: list[tuple[str, datetime]]


def log_entry_of_tenants(*, tenant_ids: frozenset[int] | None, request_id: str) -> LedgerDetail:
    """One ledger row in the caller's scope, with its timeline. Raises
    UsageRecord.DoesNotExist outside the scope (the view answers 404)."""
    rows = UsageRecord.objects.select_related("workload", "api_key", "price", "pool", "tenant")
    if tenant_ids is not None:
        rows = rows.filter(tenant_id__in=tenant_ids)
    row = rows.get(request_id=request_id)
    return LedgerDetail(entry=ledger_entry_of(row), row=row, timeline=ledger_timeline(row=row))


def ledger_timeline(*, row: UsageRecord) -> list[tuple[str, datetime]]:
    """The request's life from the ledger's timings: admitted at created_at,
    started after the queue wait, answered after the upstream call, settled
    at total. A row that never reached the pool (queue timeout) has no start."""
    admitted = row.created_at
    steps = [("admitted and queued", admitted)]
    if row.upstream_ms or row.status == UsageRecord.Status.OK:
        started = admitted + timedelta(milliseconds=row.queue_wait_ms)
        steps.append(("started on the pool", started))
        if row.ttft_ms is not None:  # streams: counted from admission
            steps.append(("first token", admitted + timedelta(milliseconds=row.ttft_ms)))
        steps.append(("pool answered", started + timedelta(milliseconds=row.upstream_ms)))
    steps.append(("settled", admitted + timedelta(milliseconds=row.total_ms)))
    return steps


def key_choices(*, tenant_ids: frozenset[int] | None) -> list[ApiKey]:
    keys = ApiKey.objects.select_related("workload").order_by("workload__slug", "prefix")
    if tenant_ids is not None:
        keys = keys.filter(workload__tenant_id__in=tenant_ids)
    return list(keys[:500])


@dataclass(frozen=True)
class RefusalDetail:
    """One refusal, from its flushed sample or, for one that was not
    sampled (or not flushed yet), from the details Redis keeps by request id
    for 24 hours."""

    request_id: str
    at: datetime
    tenant_id: int
    workload_id: int
    workload_slug: str
    pool_id: int | None
    reason: str
    message: str
    retry_after_ms: int | None
    estimated_tokens: int
    key_prefix: str
    source: str  # "sample" (the database) or "redis"

    @property
    def retry_after_s(self) -> int | None:
        """The Retry-After header's value the caller got (whole seconds, rounded up)."""
        return None if self.retry_after_ms is None else max(1, -(-self.retry_after_ms // 1000))


def refusal_of_tenants(*, tenant_ids: frozenset[int] | None, request_id: str) -> RefusalDetail:
    """A refusal in the caller's scope by the request id its answer carried
    (``x-request-id``). Raises RejectionSample.DoesNotExist outside the scope
    or when nothing holds it (the view answers 404)."""
    samples = RejectionSample.objects.select_related("workload", "api_key").filter(sample_id=request_id)
    if tenant_ids is not None:
        samples = samples.filter(tenant_id__in=tenant_ids)
    sample = samples.first()
    if sample is not None:
        return RefusalDetail(
            request_id=sample.sample_id, at=sample.at, tenant_id=sample.tenant_id, workload_id=sample.workload_id,
            workload_slug=sample.workload.slug, pool_id=sample.pool_id, reason=sample.reason, message=sample.message,
            retry_after_ms=sample.retry_after_ms, estimated_tokens=sample.estimated_tokens,
            key_prefix=sample.api_key.prefix if sample.api_key else "", source="sample")
    if not request_id or len(request_id) > 64:
        raise RejectionSample.DoesNotExist(request_id)
    data = rejection_by_request_id(request_id=request_id,
                                   pool_ids=[NO_POOL, *InferencePool.objects.values_list("id", flat=True)])
    if data is None or (tenant_ids is not None and data.get("tid") not in tenant_ids):
        raise RejectionSample.DoesNotExist(request_id)
    workload = Workload.objects.filter(pk=data.get("wid"), tenant_id=data.get("tid")).first()
    if workload is None:
        raise RejectionSample.DoesNotExist(request_id)
    key = ApiKey.objects.filter(pk=data.get("kid"), workload=workload).first() if data.get("kid") else None
    return RefusalDetail(
        request_id=request_id, at=datetime.fromtimestamp(float(data["at"]), tz=dt_timezone.utc),
        tenant_id=workload.tenant_id, workload_id=workload.id, workload_slug=workload.slug,
        pool_id=data.get("pid") or None, reason=str(data.get("reason") or ""), message=str(data.get("message") or ""),
        retry_after_ms=data.get("retry_after_ms"), estimated_tokens=int(data.get("tokens") or 0),
        key_prefix=key.prefix if key else "", source="redis")


def request_id_of_completion(*, tenant_ids: frozenset[int] | None, completion_id: str) -> str | None:
    """The request id of the ledger row whose answer had this id (the
    ``chatcmpl-...`` the SDK returned), in the caller's scope."""
    if not completion_id or len(completion_id) > 128:
        return None
    rows = UsageRecord.objects.filter(completion_id=completion_id)
    if tenant_ids is not None:
        rows = rows.filter(tenant_id__in=tenant_ids)
    return rows.order_by("-created_at").values_list("request_id", flat=True).first()


def request_exists_for_tenants(*, tenant_ids: frozenset[int] | None, request_id: str) -> bool:
    """Whether a ledger row or a refusal with this request id is in the caller's scope."""
    rows = UsageRecord.objects.filter(request_id=request_id)
    if tenant_ids is not None:
        rows = rows.filter(tenant_id__in=tenant_ids)
    if rows.exists():
        return True
    try:
        refusal_of_tenants(tenant_ids=tenant_ids, request_id=request_id)
    except RejectionSample.DoesNotExist:
        return False
    return True
