"""The Celery app, its lanes (one queue each, one worker pool each) and the
settings that make redelivery safe. Routing lives here and nowhere else."""

from __future__ import annotations

import logging
import logging.config
import os

from celery import Celery
from celery.signals import celeryd_init, setup_logging
from django.conf import settings

from adapters.kombu_redis import lane_pickup_install
from budgets.redis.clients import request_path_process
from gateway.core.db_threads import database_threads_start
from gateway.core.keys import WORKERS_READY
from gateway.core.lanes import HOUSEKEEPING

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llm_platform.settings")

# How long an idle worker's read of its queue waits (see polling_interval
# below): kombu's default. A longer wait costs less idle CPU, but a stopping
# worker waits out the read in flight after its stop grace (3 s), and a
# worker must be gone within 5 s of SIGTERM (tests/gateway/test_streaming.py,
# the orchestrator's kill timer): 5 s here broke that bound.
BROKER_POLL_S = 1.0

app = Celery("sluice")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.conf.update(
    broker_url=settings.CELERY_BROKER_URL,
    # Our tasks report results through their own Redis keys (the web side
    # waits on them); Celery's result backend would only duplicate writes.
    task_ignore_result=True,
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    # Threads started on demand, their ceiling grown to what the pools behind
    # the lane hold in flight (gateway/worker/lane_pool.py). Set here, not
    # with -P (which takes only Celery's own pool names).
    worker_pool="gateway.worker.lane_pool:LanePool",
    task_time_limit=settings.SLUICE_TASK_TIME_LIMIT_S,
    task_soft_time_limit=max(1, settings.SLUICE_TASK_TIME_LIMIT_S - 10),
    broker_transport_options={
        # A message unacknowledged this long is handed to another worker: how
        # long work of a killed worker waits before it runs again.
        "visibility_timeout": settings.SLUICE_VISIBILITY_TIMEOUT_S,
        # Look for such messages every few seconds (kombu's default sweep,
        # 10 s x every 10th poll, can leave them for minutes).
        "unacked_restore_interval": settings.SLUICE_UNACKED_RESTORE_INTERVAL_S,
        "unacked_restore_throttle": 1,
        # An idle worker's wait for its queue's next message (kombu's BRPOP
        # timeout, 1 s by default). A message pushed meanwhile answers the
        # BRPOP at once, and the restore sweep above and kombu's health checks
        # run on the event loop's own timers, so only an idle worker's re-issue
        # of the read follows this: with the default, one a second per idle
        # worker, each costing the worker and Redis CPU.
        "polling_interval": BROKER_POLL_S,
    },
    broker_connection_retry_on_startup=True,
    # Celery's Django fixup closes the task thread's database connection
    # before and after every task unless this is set: a new PostgreSQL
    # connection (a connect and its authentication) per request. Kept instead, like any Django
    # connection (CONN_MAX_AGE); execute_request replaces a broken one
    # (close_old_connections) and retries on DATABASE_AWAY.
    CELERY_DB_REUSE_MAX=1_000,
    # Each lane is a bulkhead: its own queue consumed by its own worker pool,
    # so a flood on one cannot starve another (gateway/core/lanes.py). The
    # request path names its lane's queue when it enqueues; everything else
    # (housekeeping) goes to the housekeeping lane.
    task_default_queue=HOUSEKEEPING.queue,
    task_routes={
        "budgets.*": {"queue": HOUSEKEEPING.queue},
        "gateway.reap_leases": {"queue": HOUSEKEEPING.queue},
        "gateway.take_over_lost_requests": {"queue": HOUSEKEEPING.queue},
        "gateway.run_schedule": {"queue": HOUSEKEEPING.queue},
        "gateway.deliver_callback": {"queue": HOUSEKEEPING.queue},
        "gateway.flush_key_last_used": {"queue": HOUSEKEEPING.queue},
    },
    worker_hijack_root_logger=False,
    beat_schedule={
        "push-pool-configs": {"task": "budgets.push_pool_configs", "schedule": 10.0},
        "reap-leases": {"task": "gateway.reap_leases", "schedule": 30.0},
        # API keys' last_used_at, in one batch (gateway/core/key_usage.py).
        "flush-key-last-used": {"task": "gateway.flush_key_last_used",
                                "schedule": settings.SLUICE_KEY_LAST_USED_FLUSH_S},
        # Requests of lost workers and due alert retries are the pacer's
        # (gateway/worker/pacer.py); gateway/migrations/0006 removed their
        # old entries from beat's table.
        # Read models and guardrails of the web UI (budgets.periodic_tasks).
        "flush-rejections": {"task": "budgets.flush_rejections", "schedule": 15.0},
        "rollup-daily-usage": {"task": "budgets.rollup_daily_usage", "schedule": 60.0},
        "reconcile-spend": {"task": "budgets.reconcile_spend", "schedule": 60.0},
        "expire-budget-requests": {"task": "budgets.expire_budget_requests", "schedule": 300.0},
        # Alerts (budgets/services/alerts.py): rejection spikes.
        "check-rejection-spikes": {"task": "budgets.check_rejection_spikes", "schedule": 60.0},
    },
    timezone="UTC",
)


@setup_logging.connect
@celeryd_init.connect
def _configure_logging(**kwargs) -> None:
    """Workers and beat log like every other process (settings.LOGGING: JSON
    or plain, request ids, scrubbing). Connecting to setup_logging tells
    Celery to leave logging alone: without it, it sets the root level from
    its -l flag and adds its own plain handlers. celeryd_init comes earlier,
    before the worker's start-up warnings (running as root, ...), which would
    otherwise go to stderr as plain text."""
    logging.config.dictConfig(settings.LOGGING)
    logging.captureWarnings(True)


@celeryd_init.connect
def _request_path_redis(**kwargs) -> None:
    """A lane worker runs only the request path: it waits out a busy Redis
    (budgets/redis/clients.py), its threads share a few database
    connections (gateway/core/db_threads.py), and what its first pool call
    would build while the lane's threads wait is built now
    (gateway/worker/pool_client.py)."""
    request_path_process()
    database_threads_start(settings.SLUICE_WORKER_DB_THREADS, wait_s=settings.SLUICE_WORKER_DB_WAIT_S)
    if settings.SLUICE_LANE_BATCHED_PICKUP:
        lane_pickup_install()
    # Imported here: the web process loads this module too, and never calls a pool.
    from gateway.worker.pool_client import pool_clients_warm
    pool_clients_warm()


# budgets.tasks (beat tasks) and gateway.worker.tasks (the request path's
# worker side). The web side never imports the latter: it enqueues by name.
app.autodiscover_tasks(["budgets", "gateway.worker"])


def check_time_limits(conf=app.conf) -> None:
    """Refuse to start when a task could outlive the broker's visibility
    timeout: with the Redis broker the message would then be delivered to a
    second worker while the first still runs it."""
    visibility = conf.broker_transport_options.get("visibility_timeout", 3600)
    limit = conf.task_time_limit
    if limit is None or limit >= visibility:
        raise RuntimeError(
            f"task_time_limit ({limit}s) must be below the broker visibility_timeout ({visibility}s)"
        )


check_time_limits()


# Readiness markers: `make run` and the test harness wait on these instead of
# polling the broker with `inspect ping` (slow, and noisy under load).
from celery.signals import worker_ready, worker_shutdown, worker_shutting_down  # noqa: E402
from prometheus_client import multiprocess  # noqa: E402

from budgets.redis.clients import get_redis  # noqa: E402
from gateway.worker.lane_pool import dead_workers_gauges_drop, lane_sizer_start  # noqa: E402
from gateway.worker.shutdown import shutdown_begin, shutdown_watch_start  # noqa: E402
from llm_platform.gc_tuning import gc_tune  # noqa: E402


@worker_ready.connect
def _mark_ready(sender=None, **kwargs) -> None:
    gc_tune()
    shutdown_watch_start()
    if settings.SLUICE_METRICS_DIR:
        dead_workers_gauges_drop(settings.SLUICE_METRICS_DIR)
    lane_sizer_start(sender, sender.hostname)
    get_redis().hset(WORKERS_READY, sender.hostname, sender.pid if hasattr(sender, "pid") else os.getpid())


WORKER_SHUTDOWN_GRACE_S = settings.SLUICE_WORKER_SHUTDOWN_GRACE_S  # read now, not in the handler


@worker_shutting_down.connect
def _stop_within_grace(sender=None, **kwargs) -> None:
    # Sent from the SIGTERM handler: one attribute write, nothing that locks
    # (gateway/worker/shutdown.py: calls in flight get the grace, then go back).
    shutdown_begin(grace_s=WORKER_SHUTDOWN_GRACE_S)


@worker_shutdown.connect
def _mark_gone_and_exit(sender=None, **kwargs) -> None:
    try:
        get_redis().hdel(WORKERS_READY, sender.hostname)
    except Exception:  # Redis may be the thing shutting down
        pass
    if settings.SLUICE_METRICS_DIR:
        # Its live gauges (the lane's calls running, its thread ceiling) stop
        # counting; a worker killed outright leaves them until the directory
        # is emptied at the next start (processes.metrics_dir_prepare).
        multiprocess.mark_process_dead(os.getpid(), settings.SLUICE_METRICS_DIR)
    # Sent once the worker has stopped for good: every task finished or was
    # handed back, its ack or requeue sent, the broker connection closed.
    # What is left is the interpreter's own teardown, a full garbage
    # collection of a large heap that takes seconds on a busy host and would
    # break the promise to be gone within 5 s of SIGTERM; skip it.
    logging.shutdown()
    os._exit(getattr(sender, "exitcode", None) or 0)
