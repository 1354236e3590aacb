"""The lanes, in one place: which lanes exist, the Celery queue each one is,
and how many worker threads each gets by default. Celery routing
(llm_platform/celery.py), the process list (llm_platform/processes.py),
`make run`, the test harness and the benchmarks all read them from here.

Short interactive calls must never queue behind long generations or batch
floods: each lane is its own queue with its own worker pool
(docs/architecture.md, "Lanes")."""

from __future__ import annotations

from dataclasses import dataclass

from django.conf import settings


@dataclass(frozen=True)
class Lane:
    name: str
    queue: str  # the Celery queue its worker pool consumes
    # Worker threads a lane starts with: its floor, sized by Little's law at
    # the lane's design load (concurrency ~ 2 x arrival rate x time in
    # system). Each worker then grows to what its pools can hold in flight
    # (gateway/worker/lane_pool.py), so a 1,024-slot pool is not served
    # through 40 threads. Threads, not processes: a worker mostly waits on
    # the pool's HTTP answer.
    # A streamed request holds its thread for the whole stream, first token
    # to last, as an unstreamed one holds it for the whole generation: its W
    # is queue wait + the full generation time, never just the time to first
    # token. (A slow reader does not lengthen it: chunks go to a Redis Stream
    # as they come, gateway/core/request/streams.py.) The measured W per lane
    # (gateway/core/metrics.py) is time from admission to settlement, which
    # for a stream is its end, so λ·W there already counts streams right.
    default_concurrency: int
    design_load: str
    # Worker processes the lane's threads are spread over (never more than
    # the machine's cores). A process runs Python on one core at a time (the
    # GIL), and a request costs the worker several ms of CPU, so one process
    # caps a lane near 1000 / (its ms per request) requests per second
    # whatever its thread count: the interactive lane, the one that takes
    # the traffic, gets two. Each is an ordinary Celery worker of the lane's
    # queue (node ``<lane>@host``, then ``<lane>-2@host``...).
    default_processes: int = 1

    @property
    def concurrency_env(self) -> str:
        """The environment variable (read in settings.py) that overrides the default."""
        return "SLUICE_WORKERS_" + self.name.upper().replace("-", "_")

    @property
    def processes_env(self) -> str:
        """The environment variable (read in settings.py) that overrides the default process count."""
        return "SLUICE_PROCESSES_" + self.name.upper().replace("-", "_")


INTERACTIVE = Lane("interactive", "interactive", 40, "20 req/s x ~1 s", default_processes=2)
INTERACTIVE_LONG = Lane("interactive-long", "interactive-long", 16, "2 req/s x ~4 s")
BATCH = Lane("batch", "batch", 16, "4 req/s x ~2 s")
SCHEDULED = Lane("scheduled", "scheduled", 8, "paced at ~1 req/s x ~4 s")

LANES: tuple[Lane, ...] = (INTERACTIVE, INTERACTIVE_LONG, BATCH, SCHEDULED)
LANE_NAMES: tuple[str, ...] = tuple(lane.name for lane in LANES)
_BY_NAME = {lane.name: lane for lane in LANES}

# Housekeeping (beat tasks, the lease reaper, cron firings) shares the batch
# lane's workers: it is small and rare.
HOUSEKEEPING = BATCH


def lane_named(name: str) -> Lane:
    return _BY_NAME[name]


def queue_for_lane(name: str) -> str:
    return _BY_NAME[name].queue


def lane_concurrency(name: str) -> int:
    """Worker threads of a lane: the setting where one is made, else the default."""
    return int(settings.SLUICE_LANE_CONCURRENCY.get(name, _BY_NAME[name].default_concurrency))


def lane_fixed(name: str) -> bool:
    """Whether the lane's thread count is set by hand (``SLUICE_WORKERS_<LANE>``):
    then it is kept, not sized by the pools (gateway/worker/lane_pool.py)."""
    return name in settings.SLUICE_LANE_CONCURRENCY


def lane_of_node(node: str) -> str | None:
    """The lane of a worker's Celery node name (``interactive-2@host`` ->
    ``interactive``: llm_platform/processes.py ``worker_node``), or None."""
    name = node.split("@", 1)[0]
    if name in _BY_NAME:
        return name
    base, _, index = name.rpartition("-")
    return base if index.isdigit() and base in _BY_NAME else None


def lane_processes(name: str) -> int:
    """Worker processes of a lane: the setting where one is made, else the default."""
    return max(1, int(settings.SLUICE_LANE_PROCESSES.get(name, _BY_NAME[name].default_processes)))


def lane_for(*, workload_class: str, estimated_tokens: int, borrowed: bool) -> str:
    if workload_class == "scheduled":
        return SCHEDULED.name
    # Borrowed admissions run on idle capacity: they take the batch lane and
    # are the first to wait when the pool is busy.
    if workload_class == "batch" or borrowed:
        return BATCH.name
    if estimated_tokens >= settings.SLUICE_LONG_REQUEST_TOKENS:
        return INTERACTIVE_LONG.name
    return INTERACTIVE.name
