"""Sluice settings: everything comes from the environment, with embedded
defaults that work on a fresh machine (SQLite file, embedded Redis started by
``make run``, the simulated pool). Production differs only by environment;
``.env.example`` lists every variable."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

import dj_database_url
from csp.constants import NONCE, NONE, SELF
from django.core.exceptions import ImproperlyConfigured

from gateway.core.lanes import LANES

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("SLUICE_VAR_DIR", BASE_DIR / "var"))


def env_bool(name: str, default: bool) -> bool:
    return os.environ.get(name, str(default)).strip().lower() in {"1", "true", "yes", "on"}


def env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def env_float(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


# "local" (make run, the tests, a laptop) or "production": the one switch
# between them. Production turns on HTTPS-only behaviour (HSTS, secure
# cookies, the HTTPS redirect); each of those can still be set on its own.
SLUICE_ENV = os.environ.get("SLUICE_ENV", "local").strip().lower()
if SLUICE_ENV not in {"local", "production"}:
    raise ImproperlyConfigured(f"SLUICE_ENV must be 'local' or 'production', not {SLUICE_ENV!r}.")
PRODUCTION = SLUICE_ENV == "production"

DEBUG = env_bool("DJANGO_DEBUG", False)
if PRODUCTION and DEBUG:
    raise ImproperlyConfigured("DJANGO_DEBUG=true with SLUICE_ENV=production would show tracebacks to the world.")


SECRET_KEY_MISSING = (
    "DJANGO_SECRET_KEY is not set. `make run` and the tests bring their own; anywhere else set it to a long "
    "random value, e.g. python -c 'import secrets; print(secrets.token_urlsafe(50))'."
)


class _MissingSecretKey:
    """Stands in for an unset key: the first use of ``settings.SECRET_KEY``
    (gateway/apps.py makes one when Django starts: web, workers, beat, pacer,
    manage.py) fails with SECRET_KEY_MISSING. Loading settings alone does not,
    so `make run` can read them before it writes the key its children use."""

    def __bool__(self) -> bool:
        raise ImproperlyConfigured(SECRET_KEY_MISSING)

    __str__ = __len__ = __bool__


def _secret_key() -> str | _MissingSecretKey:
    """DJANGO_SECRET_KEY, required everywhere but where a key comes with the
    run: the tests (pytest sets PYTEST_VERSION for its session and for the
    processes it starts) and a local checkout where `make run` wrote
    var/secret_key (so `manage.py seed_demo --json` works beside it)."""
    key = os.environ.get("DJANGO_SECRET_KEY", "")
    if key:
        return key
    if os.environ.get("PYTEST_VERSION"):
        return "insecure-tests-only-" + "sluice-test-session-key"
    local_key = VAR_DIR / "secret_key"
    if not PRODUCTION and local_key.is_file():
        return local_key.read_text().strip()
    return _MissingSecretKey()


SECRET_KEY = _secret_key()
ALLOWED_HOSTS = [h.strip() for h in os.environ.get("DJANGO_ALLOWED_HOSTS", "localhost,127.0.0.1,[::1],testserver").split(",")]
CSRF_TRUSTED_ORIGINS = [o for o in os.environ.get("DJANGO_CSRF_TRUSTED_ORIGINS", "").split(",") if o]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "django_celery_beat",
    "csp",
    "tenants",
    "budgets",
    "gateway",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "csp.middleware.CSPMiddleware",
    # Static files answer here, before sessions and auth. Sync-only, like
    # StoreUnavailableMiddleware below: the stack runs in one thread hop either way.
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "tenants.middleware.FinanceReadOnlyMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "llm_platform.degraded.StoreUnavailableMiddleware",
]

ROOT_URLCONF = "llm_platform.urls"
ASGI_APPLICATION = "llm_platform.asgi.application"
WSGI_APPLICATION = "llm_platform.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "llm_platform.degraded.store_status",
            ],
            # The web UI's template helpers live with the pages (budgets/web/).
            "libraries": {"sluice_ui": "budgets.web.templatetags.sluice_ui"},
        },
    },
]

# --- database -----------------------------------------------------------------
DATABASE_URL = os.environ.get("DATABASE_URL") or f"sqlite:///{VAR_DIR / 'sluice.sqlite3'}"
DATABASES = {"default": dj_database_url.parse(DATABASE_URL, conn_max_age=int(os.environ.get("DB_CONN_MAX_AGE", 60)))}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # Workers write the ledger concurrently: WAL lets readers run beside one
    # writer, and the busy timeout queues writers instead of failing them.
    # Connections are kept like PostgreSQL's (DB_CONN_MAX_AGE): a new one per
    # ledger row would rerun the PRAGMAs and Django's function registration
    # on every request.
    DATABASES["default"]["OPTIONS"] = {
        "timeout": 20,
        "transaction_mode": "IMMEDIATE",
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL; PRAGMA busy_timeout=20000;",
    }
if DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
    # A PostgreSQL that does not answer (a hung host, a network that drops
    # packets) fails a connection attempt after DB_CONNECT_TIMEOUT_S and a
    # kept connection after about 30 s, instead of libpq's wait without end
    # and the kernel's minutes of retransmissions: the thread waiting on it
    # gets the database's error (retried, or answered 503) and is free
    # again. A statement that waits on a lock (a migration's, a stuck
    # transaction's) fails after DB_LOCK_TIMEOUT_S, cancelled by the server
    # (nothing it wrote commits later), instead of queueing every later
    # statement on that table behind it (0: no bound, and no startup
    # ``options`` sent: a pooler such as PgBouncer refuses them unless told
    # to ignore them). Options in DATABASE_URL's query win.
    _bounds = {
        "connect_timeout": env_int("DB_CONNECT_TIMEOUT_S", 5),
        "keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5, "keepalives_count": 3,
        "tcp_user_timeout": 30_000,  # ms of data sent and not acknowledged
    }
    DB_LOCK_TIMEOUT_S = env_float("DB_LOCK_TIMEOUT_S", 10.0)
    if DB_LOCK_TIMEOUT_S > 0:
        _bounds["options"] = f"-c lock_timeout={max(1, round(DB_LOCK_TIMEOUT_S * 1000))}"
    for _option, _value in _bounds.items():
        DATABASES["default"].setdefault("OPTIONS", {}).setdefault(_option, _value)
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # The demo database cannot enforce unique-with-NULLs constraints; the
    # rejection flush stays correct without them (one flusher at a time).
    SILENCED_SYSTEM_CHECKS = ["models.W047"]

# --- redis / celery -------------------------------------------------------------
REDIS_URL = os.environ.get("REDIS_URL") or f"unix://{VAR_DIR / 'redis.sock'}?db=0"
# true: REDIS_URL names one node of a Redis Cluster (buckets, leases, request
# records, results; every script's keys share a hash tag). Celery's Redis
# broker cannot use a cluster, so CELERY_BROKER_URL must then name a plain Redis.
SLUICE_REDIS_CLUSTER = env_bool("SLUICE_REDIS_CLUSTER", False)
if SLUICE_REDIS_CLUSTER and not os.environ.get("CELERY_BROKER_URL"):
    raise ImproperlyConfigured(
        "SLUICE_REDIS_CLUSTER=true needs CELERY_BROKER_URL: Celery's Redis broker cannot run on a cluster; "
        "point it at a plain Redis."
    )
_BROKER_ON_REDIS_URL = REDIS_URL.replace("unix://", "redis+socket://") if REDIS_URL.startswith("unix://") else REDIS_URL
CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL") or _BROKER_ON_REDIS_URL
CELERY_BROKER_IS_REDIS_URL = CELERY_BROKER_URL == _BROKER_ON_REDIS_URL and not SLUICE_REDIS_CLUSTER
# The web side writes a lane's Celery message in the same Redis pipeline as
# the request's record (adapters/celery.py) when the broker is
# REDIS_URL itself; false: every message goes through Celery's send_task.
SLUICE_DIRECT_PUBLISH = env_bool("SLUICE_DIRECT_PUBLISH", True)
# A lane worker on a Redis broker takes the messages waiting behind the one
# that woke it in the same turn, each popped and recorded unacknowledged in
# one step (adapters/kombu_redis.py); false: kombu's one message per turn.
SLUICE_LANE_BATCHED_PICKUP = env_bool("SLUICE_LANE_BATCHED_PICKUP", True)

# A task must finish (or be killed) well before the broker would hand its
# unacknowledged message to another worker: visibility_timeout > time limit.
SLUICE_TASK_TIME_LIMIT_S = env_int("SLUICE_TASK_TIME_LIMIT_S", 300)
SLUICE_VISIBILITY_TIMEOUT_S = env_int("SLUICE_VISIBILITY_TIMEOUT_S", 900)
SLUICE_UNACKED_RESTORE_INTERVAL_S = env_int("SLUICE_UNACKED_RESTORE_INTERVAL_S", 5)

# A lost worker (SIGKILL, OOM, a host gone) is noticed by its silence: each
# worker process renews a heartbeat of every call it runs each interval
# (gateway/worker/heartbeat.py); one older than the TTL is a lost worker.
# Callers wait at most TTL + interval to learn of it, then get the result of a
# redelivery or a 503 (gateway/core/request/claim.lua).
SLUICE_HEARTBEAT_INTERVAL_S = env_float("SLUICE_HEARTBEAT_INTERVAL_S", 1.0)
SLUICE_HEARTBEAT_TTL_S = env_float("SLUICE_HEARTBEAT_TTL_S", 3.0)
if SLUICE_HEARTBEAT_TTL_S < 2 * SLUICE_HEARTBEAT_INTERVAL_S:
    raise ImproperlyConfigured("SLUICE_HEARTBEAT_TTL_S must be at least twice SLUICE_HEARTBEAT_INTERVAL_S: "
                               "one late beat must not look like a lost worker.")
# How long a request taken from a lost worker may wait in its lane for a live
# one before its caller gets a 503 (never past the request's retry deadline).
SLUICE_REDELIVERY_WAIT_S = env_float("SLUICE_REDELIVERY_WAIT_S", 5.0)
# How often each pacer sweeps the lanes for requests of lost workers that no
# web process watches (jobs, or a web host lost too; gateway/worker/pacer.py).
# 0: this host's pacers do not sweep (tests that take requests over themselves).
SLUICE_TAKEOVER_SWEEP_S = env_float("SLUICE_TAKEOVER_SWEEP_S", 5.0)

# --- gateway ----------------------------------------------------------------------
# Requests whose estimate (prompt + max_tokens) is at least this go to
# interactive-long, so short calls never queue behind long generations.
SLUICE_LONG_REQUEST_TOKENS = env_int("SLUICE_LONG_REQUEST_TOKENS", 2048)
SLUICE_MAX_BODY_BYTES = env_int("SLUICE_MAX_BODY_BYTES", 2 * 1024 * 1024)
# What one image in a prompt is estimated at (tokens); settlement corrects it
# to what the pool reports. Default: gpt-4o's largest high-detail image.
SLUICE_IMAGE_TOKENS = env_int("SLUICE_IMAGE_TOKENS", 1105)
# Callers may steer a simulated pool's test switches (the body's "sim":
# latency, output length, injected failures) only where this is on AND the
# pool is marked is_simulator. Off by default: on a real deployment a caller
# must not be able to make the pool fail for everyone. `make run`, the tests
# and bench turn it on for their simulator.
SLUICE_SIM_CONTROLS = env_bool("SLUICE_SIM_CONTROLS", False)
SLUICE_UPSTREAM_TIMEOUT_S = env_float("SLUICE_UPSTREAM_TIMEOUT_S", 120.0)
# Non-streamed calls to a plain http:// pool (no proxy) on the standard
# library's http.client, not httpx (gateway/worker/pool_client.py).
SLUICE_POOL_PLAIN_HTTP = env_bool("SLUICE_POOL_PLAIN_HTTP", True)
# Streams on the plain path are read and relayed by one thread per lane
# worker process (gateway/worker/stream_hub.py); false: each on its call's thread.
SLUICE_STREAM_HUB = env_bool("SLUICE_STREAM_HUB", True)
# How long workload/key lookups are cached in each web process; reservation
# changes reach admission through Redis at once, caps within this many seconds.
SLUICE_AUTH_CACHE_S = env_float("SLUICE_AUTH_CACHE_S", 5.0)
# Redis refusing or not accepting a connection: every call fails within this.
SLUICE_REDIS_TIMEOUT_S = env_float("SLUICE_REDIS_TIMEOUT_S", 0.5)
# A busy Redis (it took the command, its answer is slow) is waited for this
# long on the request path, within any request's deadline (budgets/redis/clients.py).
SLUICE_REDIS_BUSY_WAIT_S = env_float("SLUICE_REDIS_BUSY_WAIT_S", 3.0)
# How many /v1 requests each web process admits at once; the rest wait at the
# door, tenants and then workloads in turn, at most SLUICE_REDIS_BUSY_WAIT_S
# (gateway/web/admission_turns.py). 0: no turns, every request at once.
SLUICE_WEB_ADMISSIONS_AT_ONCE = env_int("SLUICE_WEB_ADMISSIONS_AT_ONCE", 32)
SLUICE_RESULT_TTL_S = env_int("SLUICE_RESULT_TTL_S", 3600)
# An async job's default deadline; a job that budget would hold past it is refused.
SLUICE_JOB_DEADLINE_S = env_float("SLUICE_JOB_DEADLINE_S", 3600.0)
# --- the Batch API (gateway/core/batches) --------------------------------------------------
# Files live in Django's default storage: a directory under the var dir here,
# any storage backend in a deployment (STORAGES["default"]).
MEDIA_ROOT = Path(os.environ.get("SLUICE_FILES_DIR") or VAR_DIR / "files")
# An uploaded file's limit (streamed to storage, never held whole in memory),
# one line's, and a batch's lines (OpenAI's: 200 MB, 50,000 requests).
SLUICE_BATCH_FILE_MAX_BYTES = env_int("SLUICE_BATCH_FILE_MAX_BYTES", 200 * 1024 * 1024)
SLUICE_BATCH_LINE_MAX_BYTES = env_int("SLUICE_BATCH_LINE_MAX_BYTES", 1024 * 1024)
SLUICE_BATCH_MAX_LINES = env_int("SLUICE_BATCH_MAX_LINES", 50_000)
# Lines of one workload's batches waiting for budget or on the batch lane at
# once: the feeder (the pacer) gives its batches their next lines as these finish.
SLUICE_BATCH_LINES_IN_FLIGHT = env_int("SLUICE_BATCH_LINES_IN_FLIGHT", 64)
# The share of a pool's in-flight limit that batch lines (every workload's
# whose primary pool it is) may hold at once; interactive calls keep the rest.
SLUICE_BATCH_POOL_SHARE = env_float("SLUICE_BATCH_POOL_SHARE", 0.125)
# How long an admitted line may wait on the lane before it goes back to the
# batch's pending lines (it never ran: the claim makes sure).
SLUICE_BATCH_LINE_QUEUE_S = env_float("SLUICE_BATCH_LINE_QUEUE_S", 600.0)
# --- job callbacks (gateway/core/jobs/callbacks.py) -----------------------------------------
# Callbacks go to https URLs on public addresses only. Plain http, and private
# or loopback receivers (a test listener, a receiver inside your own network),
# each need their switch; cloud metadata, link-local, multicast and reserved
# addresses are refused whatever the switches say.
SLUICE_CALLBACK_ALLOW_HTTP = env_bool("SLUICE_CALLBACK_ALLOW_HTTP", False)
SLUICE_CALLBACK_ALLOW_PRIVATE = env_bool("SLUICE_CALLBACK_ALLOW_PRIVATE", False)
SLUICE_CALLBACK_TIMEOUT_S = env_float("SLUICE_CALLBACK_TIMEOUT_S", 5.0)
# Attempts per callback, the first included; between attempts an exponential
# backoff (base x 2^(n-1), capped, jittered) waits in Redis, not in Celery.
SLUICE_CALLBACK_MAX_ATTEMPTS = env_int("SLUICE_CALLBACK_MAX_ATTEMPTS", 8)
SLUICE_CALLBACK_BACKOFF_BASE_S = env_float("SLUICE_CALLBACK_BACKOFF_BASE_S", 2.0)
SLUICE_CALLBACK_BACKOFF_CAP_S = env_float("SLUICE_CALLBACK_BACKOFF_CAP_S", 600.0)
# Alerts (budgets/services/alerts.py): e-mail through Django's backend (SMTP
# by default; make run uses the console), webhooks retried like job callbacks
# (the SLUICE_CALLBACK_* attempts, backoff and URL rules). A rejection spike:
# at least PER_MINUTE rejections for a tenant in each of the last MINUTES minutes.
EMAIL_BACKEND = os.environ.get("EMAIL_BACKEND", "django.core.mail.backends.smtp.EmailBackend")
EMAIL_HOST = os.environ.get("EMAIL_HOST", "localhost")
EMAIL_PORT = env_int("EMAIL_PORT", 25)
EMAIL_HOST_USER = os.environ.get("EMAIL_HOST_USER", "")
EMAIL_HOST_PASSWORD = os.environ.get("EMAIL_HOST_PASSWORD", "")
EMAIL_USE_TLS = env_bool("EMAIL_USE_TLS", False)
EMAIL_TIMEOUT = env_float("EMAIL_TIMEOUT", 10.0)
# Where django.core.mail.backends.filebased.EmailBackend writes (one file per message).
EMAIL_FILE_PATH = os.environ.get("EMAIL_FILE_PATH") or str(VAR_DIR / "mail")
DEFAULT_FROM_EMAIL = os.environ.get("DEFAULT_FROM_EMAIL", "sluice@localhost")
SLUICE_ALERT_REJECTION_SPIKE_PER_MINUTE = env_int("SLUICE_ALERT_REJECTION_SPIKE_PER_MINUTE", 100)
SLUICE_ALERT_REJECTION_SPIKE_MINUTES = env_int("SLUICE_ALERT_REJECTION_SPIKE_MINUTES", 5)

# --- attempt throttles (gateway/core/protection/throttle.py) ----------------------------------------
# Failed sign-ins (web login, Django admin, /api/auth/token/) counted per
# user and per client address; past either limit sign-in answers 429 until
# the window (counted from the first failure) ends. A limit of 0 turns it off.
SLUICE_LOGIN_FAILURES_PER_USER = env_int("SLUICE_LOGIN_FAILURES_PER_USER", 10)
SLUICE_LOGIN_FAILURES_PER_ADDRESS = env_int("SLUICE_LOGIN_FAILURES_PER_ADDRESS", 50)
SLUICE_LOGIN_FAILURE_WINDOW_S = env_int("SLUICE_LOGIN_FAILURE_WINDOW_S", 900)
# Unknown or revoked API keys on /v1 per client address; past the limit, 429.
SLUICE_API_KEY_FAILURES_PER_ADDRESS = env_int("SLUICE_API_KEY_FAILURES_PER_ADDRESS", 100)
SLUICE_API_KEY_FAILURE_WINDOW_S = env_int("SLUICE_API_KEY_FAILURE_WINDOW_S", 60)
# The client address is REMOTE_ADDR, unless REMOTE_ADDR is one of these
# proxies (comma-separated addresses or CIDRs): then it is the nearest
# X-Forwarded-For hop that is not one of them.
SLUICE_TRUSTED_PROXIES = tuple(p.strip() for p in os.environ.get("SLUICE_TRUSTED_PROXIES", "").split(",") if p.strip())
# Keys remembered per web process: valid ones and, apart, unknown ones (a
# flood of random keys only churns the second).
SLUICE_AUTH_CACHE_SIZE = env_int("SLUICE_AUTH_CACHE_SIZE", 10_000)
# How often (at most) each web process asks the database which keys were
# revoked lately: a revoked key stops working within about this long.
SLUICE_AUTH_REVOCATION_POLL_S = env_float("SLUICE_AUTH_REVOCATION_POLL_S", 0.5)
# While the database is away, a key a web process checked within this long is
# served as it was last checked (0: never); a key it cannot check answers 503.
SLUICE_AUTH_STALE_S = env_float("SLUICE_AUTH_STALE_S", 300.0)
# A key lookup the database has not answered in this long counts as the
# database away (the key served as last checked, else 503); it goes on.
SLUICE_AUTH_LOOKUP_WAIT_S = env_float("SLUICE_AUTH_LOOKUP_WAIT_S", 2.0)
# Key last-use: each web process sends its notes to Redis at most this often;
# beat writes them to ApiKey.last_used_at every SLUICE_KEY_LAST_USED_FLUSH_S.
SLUICE_KEY_LAST_USED_PUSH_S = env_float("SLUICE_KEY_LAST_USED_PUSH_S", 5.0)
SLUICE_KEY_LAST_USED_FLUSH_S = env_float("SLUICE_KEY_LAST_USED_FLUSH_S", 30.0)

# The port `make run` serves on, for the URLs it prints (seed_demo --json).
PORT = env_int("PORT", 8000)
# The simulated pool used by `make run` and the tests.
SLUICE_SIM_URL = os.environ.get("SLUICE_SIM_URL", "http://127.0.0.1:8100/v1")
# The demo's second simulated pool (sim-overflow: pay-as-you-go overflow
# behind sim-pool), its own simulator process under `make run`.
SLUICE_SIM_OVERFLOW_URL = os.environ.get("SLUICE_SIM_OVERFLOW_URL", "http://127.0.0.1:8101/v1")

# --- health (gateway/web/health.py) and pool probes (gateway/worker/prober.py) ------
# /healthz (the process answers) and /readyz (database and Redis answer) tell
# anonymous callers only up or down; details go to platform admins and to
# callers with "Authorization: Bearer <this token>" (empty: admins only).
SLUICE_HEALTH_TOKEN = os.environ.get("SLUICE_HEALTH_TOKEN", "")
# The pacer process probes every active pool this often (GET <base_url>/models;
# 0 turns probing off). A pool that fails this many probes in a row admits
# nothing (503 pool_unavailable) until a probe succeeds; the mark lapses by
# itself three intervals after the last failed probe, so a stopped prober
# cannot keep a pool shut.
SLUICE_POOL_PROBE_INTERVAL_S = env_float("SLUICE_POOL_PROBE_INTERVAL_S", 5.0)
SLUICE_POOL_PROBE_TIMEOUT_S = env_float("SLUICE_POOL_PROBE_TIMEOUT_S", 2.0)
SLUICE_POOL_PROBE_FAILURES = env_int("SLUICE_POOL_PROBE_FAILURES", 2)

# --- stopping (docs/RELIABILITY.md) --------------------------------------------------
# Every process exits within 5 s of SIGTERM. A lane worker lets pool calls in
# flight answer for this long, then hands the rest back (gateway/worker/shutdown.py).
SLUICE_WORKER_SHUTDOWN_GRACE_S = env_float("SLUICE_WORKER_SHUTDOWN_GRACE_S", 3.0)
# The web server lets requests in flight finish for this long, then closes them
# (their admitted work still runs, settles and reaches the ledger).
SLUICE_WEB_SHUTDOWN_GRACE_S = env_float("SLUICE_WEB_SHUTDOWN_GRACE_S", 3.0)
# `make run` (llm_platform/supervisor.py) starts a process that died again after
# this backoff, doubled for each death in a row within a minute of its start,
# up to the maximum, and at most this many times a minute: a crash loop waits.
SLUICE_RUN_RESTART_BACKOFF_S = env_float("SLUICE_RUN_RESTART_BACKOFF_S", 1.0)
SLUICE_RUN_RESTART_BACKOFF_MAX_S = env_float("SLUICE_RUN_RESTART_BACKOFF_MAX_S", 30.0)
SLUICE_RUN_RESTARTS_PER_MINUTE = env_int("SLUICE_RUN_RESTARTS_PER_MINUTE", 5)

# Worker threads per lane, set by hand: SLUICE_WORKERS_INTERACTIVE,
# SLUICE_WORKERS_INTERACTIVE_LONG, SLUICE_WORKERS_BATCH, SLUICE_WORKERS_SCHEDULED.
# Unset (the default), a lane starts at its floor (gateway/core/lanes.py) and
# grows to what its pools can hold in flight (gateway/worker/lane_pool.py); set,
# it keeps the number given.
SLUICE_LANE_CONCURRENCY = {lane.name: env_int(lane.concurrency_env, lane.default_concurrency) for lane in LANES
                           if lane.concurrency_env in os.environ}
# Database connections per lane worker process: its calls' ledger rows go
# through this many threads (gateway/core/db_threads.py), however many calls it runs.
SLUICE_WORKER_DB_THREADS = env_int("SLUICE_WORKER_DB_THREADS", 8)
# How long a lane worker's call waits for its database work (the ledger row, a
# job's end) before it counts the database as away and its task is retried
# later, so a lock or a hung database holds no lane thread (0: no bound).
SLUICE_WORKER_DB_WAIT_S = env_float("SLUICE_WORKER_DB_WAIT_S", 2.0)
# How often a lane worker looks whether its pools' in-flight limits rose.
SLUICE_LANE_SIZE_CHECK_S = env_float("SLUICE_LANE_SIZE_CHECK_S", 5.0)
# Worker processes per lane, its threads split evenly among them
# (SLUICE_PROCESSES_INTERACTIVE, ...; gateway/core/lanes.py says why the
# interactive lane has two). The default never exceeds the machine's cores.
SLUICE_LANE_PROCESSES = {lane.name: max(1, env_int(lane.processes_env,
                                                   min(lane.default_processes, os.cpu_count() or 1)))
                         for lane in LANES}

# --- adaptive pool capacity (budgets/admission/capacity.py) ------------------------
# Multiply the pool's admission rate by this on a throttle signal (TCP-style halving).
SLUICE_CAPACITY_DECREASE = env_float("SLUICE_CAPACITY_DECREASE", 0.5)
# Recover this share of the configured rate per second of clean calls (a
# halving is undone in ~25 s).
SLUICE_CAPACITY_RECOVERY_PER_S = env_float("SLUICE_CAPACITY_RECOVERY_PER_S", 0.02)
# Never admit below this share of the configured rate.
SLUICE_CAPACITY_MIN_FACTOR = env_float("SLUICE_CAPACITY_MIN_FACTOR", 0.05)
# Upstream 429s arriving within this window are one signal: they were all sent
# before the first decrease could take effect.
SLUICE_CAPACITY_COOLDOWN_MS = env_int("SLUICE_CAPACITY_COOLDOWN_MS", 2000)
# Latency per output token this many times its slow baseline counts as a throttle...
SLUICE_CAPACITY_LATENCY_RATIO = env_float("SLUICE_CAPACITY_LATENCY_RATIO", 3.0)
# ...but latency per token below this (ms) never does.
SLUICE_CAPACITY_LATENCY_FLOOR_MS = env_float("SLUICE_CAPACITY_LATENCY_FLOOR_MS", 5.0)
# How long the factor at the last throttle caps fast recovery (ms).
SLUICE_CAPACITY_HINT_MEMORY_MS = env_int("SLUICE_CAPACITY_HINT_MEMORY_MS", 60_000)

# --- adaptive long-lane concurrency (gateway/core/protection/concurrency.py, gateway/core/protection/lane_limit.lua)
# How many interactive-long (and, separately, batch) requests may be in a call
# to one pool at once is learned by AIMD from the short requests' latency per
# token; these shape the rule, not the level it finds.
# A pool's lanes start here (and fall or grow from it).
SLUICE_LANE_LIMIT_INITIAL = env_float("SLUICE_LANE_LIMIT_INITIAL", 4.0)
# Never below / above these many concurrent calls per lane and pool.
SLUICE_LANE_LIMIT_MIN = env_float("SLUICE_LANE_LIMIT_MIN", 1.0)
SLUICE_LANE_LIMIT_MAX = env_float("SLUICE_LANE_LIMIT_MAX", 256.0)
# Short latency per token this many times its idle baseline is congestion.
SLUICE_LANE_LIMIT_CONGESTION_RATIO = env_float("SLUICE_LANE_LIMIT_CONGESTION_RATIO", 2.0)
# On congestion or an upstream 429 the limit becomes min(limit - 1, limit x this).
SLUICE_LANE_LIMIT_DECREASE = env_float("SLUICE_LANE_LIMIT_DECREASE", 0.75)
# At most one decrease per this many ms (a burst of slow answers is one signal).
SLUICE_LANE_LIMIT_COOLDOWN_MS = env_int("SLUICE_LANE_LIMIT_COOLDOWN_MS", 1000)
# Short samples before the baseline may call anything congestion.
SLUICE_LANE_LIMIT_WARMUP_SAMPLES = env_int("SLUICE_LANE_LIMIT_WARMUP_SAMPLES", 10)
# The idle baseline (the lowest latency per token seen) drifts up this much
# per sample, so a pool that got slower for good is relearned.
SLUICE_LANE_LIMIT_BASELINE_DRIFT = env_float("SLUICE_LANE_LIMIT_BASELINE_DRIFT", 0.002)
# Weight of each fresh sample in the recent short latency (an EWMA).
SLUICE_LANE_LIMIT_EWMA_WEIGHT = env_float("SLUICE_LANE_LIMIT_EWMA_WEIGHT", 0.5)
# The level at which congestion last appeared is not probed again for this long (ms).
SLUICE_LANE_LIMIT_MEMORY_MS = env_int("SLUICE_LANE_LIMIT_MEMORY_MS", 60_000)

# --- the pool's circuit breaker (gateway/core/protection/circuit.py, gateway/core/protection/circuit.lua) --------
# Calls in a row that fail (5xx, no answer) before the circuit opens.
SLUICE_CIRCUIT_FAILURES = env_int("SLUICE_CIRCUIT_FAILURES", 5)
# Seconds the circuit stays open before one trial call (half-open) may go.
SLUICE_CIRCUIT_OPEN_S = env_float("SLUICE_CIRCUIT_OPEN_S", 1.0)
# Each failed trial doubles that, up to this (at most: SLUICE_CIRCUIT_OPEN_S,
# no doubling). Above it, a long outage costs a trial call every few seconds
# instead of every second, but a recovery is seen that much later, and work
# held through the outage (gateway/core/protection/held.py) gets its trials
# that much less often: more of it reaches its queue timeout.
SLUICE_CIRCUIT_OPEN_MAX_S = env_float("SLUICE_CIRCUIT_OPEN_MAX_S", 1.0)
# Work held through an outage (gateway/core/protection/held.py): the seconds over which
# the rate of fresh arrivals is averaged, and how many seconds of the
# provider's spare rate held work may take at once when it is released.
SLUICE_HELD_PACE_S = env_float("SLUICE_HELD_PACE_S", 10.0)

# --- the worker's retry policy (gateway/worker/retry.py) ---------------------------
# Attempts per call, the first included; the SDK's own retries are off.
SLUICE_RETRY_MAX_ATTEMPTS = env_int("SLUICE_RETRY_MAX_ATTEMPTS", 2)
# Full-jitter backoff window: base x 2^(attempt-1), capped (ms).
SLUICE_RETRY_BASE_MS = env_float("SLUICE_RETRY_BASE_MS", 250)
SLUICE_RETRY_CAP_MS = env_float("SLUICE_RETRY_CAP_MS", 8000)
# Retries stay under this share of first attempts, pool-wide, plus a burst.
SLUICE_RETRY_POOL_RATIO = env_float("SLUICE_RETRY_POOL_RATIO", 0.1)
SLUICE_RETRY_POOL_BURST = env_float("SLUICE_RETRY_POOL_BURST", 10)
# Retries per client session (X-Session-Id), kept this long (ms).
SLUICE_RETRY_SESSION_BUDGET = env_int("SLUICE_RETRY_SESSION_BUDGET", 3)
SLUICE_RETRY_SESSION_TTL_MS = env_int("SLUICE_RETRY_SESSION_TTL_MS", 600_000)

REST_FRAMEWORK = {
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    # The management API (/api/*): token auth for scripts, the session for the
    # browsable docs. Every view states its own role rules on top.
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.TokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    # JSON with /v1's size, depth and number guards (DRF's own parser lets a
    # deeply nested body raise RecursionError: a 500).
    "DEFAULT_PARSER_CLASSES": [
        "llm_platform.api_input.GuardedJSONParser",
        "rest_framework.parsers.FormParser",
        "rest_framework.parsers.MultiPartParser",
    ],
    "EXCEPTION_HANDLER": "llm_platform.api_errors.api_exception_handler",
    "DEFAULT_PAGINATION_CLASS": "rest_framework.pagination.LimitOffsetPagination",
    "PAGE_SIZE": 100,
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Sluice management API",
    "DESCRIPTION": "Tenants, workloads, API keys, pools, budget-slice requests, usage and the ledger. "
                   "Authenticate with `Authorization: Token <token>`.",
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    # Swagger UI's assets come from the drf-spectacular-sidecar package (PyPI), not a CDN.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "SCHEMA_PATH_PREFIX": r"/api/",
    "ENUM_NAME_OVERRIDES": {"WorkloadClassEnum": "tenants.models.Workload.WorkloadClass"},
    # The /v1 API is plain Django views: gateway/web/openapi.py adds it.
    "POSTPROCESSING_HOOKS": ["drf_spectacular.hooks.postprocess_schema_enums", "gateway.web.openapi.add_v1_paths"],
}
# Static files (the web UI's and the API docs' assets) are served by
# WhiteNoise straight from the installed packages, so no collectstatic step
# is needed to run (until one fills STATIC_ROOT, WhiteNoise warns once at
# startup that it is missing).
WHITENOISE_USE_FINDERS = env_bool("SLUICE_STATIC_FROM_FINDERS", True)

# Rejections: detailed samples kept per minute per workload and reason, and
# how long flushed samples are kept.
SLUICE_REJECTION_SAMPLES_PER_MINUTE = env_int("SLUICE_REJECTION_SAMPLES_PER_MINUTE", 5)
# A web process sends the rejections it counted to Redis at most this often
# (the first one after a quiet tick at once; budgets/ledger/rejections.py).
SLUICE_REJECTION_PUSH_S = env_float("SLUICE_REJECTION_PUSH_S", 1.0)
SLUICE_REJECTION_SAMPLE_RETENTION_DAYS = env_int("SLUICE_REJECTION_SAMPLE_RETENTION_DAYS", 30)
# Every refusal's details stay in Redis, findable by its request id, for at
# least 24 hours (one hash per pool and hour), at most this many per pool and
# hour: the cap bounds Redis's memory under a refusal storm (docs/architecture.md,
# "Finding a request"); counts stay exact past it.
SLUICE_REFUSAL_LOOKUP_PER_POOL_HOUR = env_int("SLUICE_REFUSAL_LOOKUP_PER_POOL_HOUR", 50_000)

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]
LOGIN_URL = "/accounts/login/"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/accounts/login/"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"

# --- observability (docs/observability.md) -------------------------------------------
# Prometheus metrics of every process, added up by /metrics: the directory
# where each process writes its values (prometheus-client's multiprocess
# mode, which reads this same variable). Unset: /metrics shows the web
# process's own numbers only. Empty it before the processes start (`make run`
# and the tests do): files of processes that are gone would add up forever.
SLUICE_METRICS_DIR = os.environ.get("PROMETHEUS_MULTIPROC_DIR", "")
if "PROMETHEUS_MULTIPROC_DIR" in os.environ and not SLUICE_METRICS_DIR:
    # Set but empty (an `.env` line left blank) would make prometheus-client
    # write its files into the working directory.
    del os.environ["PROMETHEUS_MULTIPROC_DIR"]
# Who may scrape /metrics: a request bearing this token (Authorization:
# Bearer <token>), or one from these networks that came through no proxy
# (no X-Forwarded-For / Forwarded / X-Real-IP). Empty token and networks:
# /metrics refuses everyone.
SLUICE_METRICS_TOKEN = os.environ.get("SLUICE_METRICS_TOKEN", "")
SLUICE_METRICS_ALLOWED_NETWORKS = [ipaddress.ip_network(n.strip(), strict=False) for n in os.environ.get(
    "SLUICE_METRICS_ALLOWED_NETWORKS", "127.0.0.1/32,::1/128").split(",") if n.strip()]

# Log lines of every process: "json" (one object per line, for a log
# pipeline) or "plain" (for a terminal). /v1 requests get one access line
# each (logger sluice.access), settled requests one more (sluice.settlement).
SLUICE_LOG_FORMAT = os.environ.get("SLUICE_LOG_FORMAT", "json").strip().lower()
if SLUICE_LOG_FORMAT not in {"json", "plain"}:
    raise ValueError(f"SLUICE_LOG_FORMAT must be 'json' or 'plain', not {SLUICE_LOG_FORMAT!r}")
LOG_LEVEL = os.environ.get("LOG_LEVEL", "INFO").upper()

# --- HTTPS and browser security (`manage.py check --deploy` is clean in production) ---
# Behind a TLS-terminating proxy, name the header it sets (e.g.
# X-Forwarded-Proto) so Django knows the request came in over HTTPS; set it
# only where that proxy strips the header from what clients send.
SLUICE_PROXY_SSL_HEADER = os.environ.get("DJANGO_SECURE_PROXY_SSL_HEADER", "").strip()
if SLUICE_PROXY_SSL_HEADER:
    SECURE_PROXY_SSL_HEADER = ("HTTP_" + SLUICE_PROXY_SSL_HEADER.upper().replace("-", "_"), "https")
SECURE_SSL_REDIRECT = env_bool("DJANGO_SECURE_SSL_REDIRECT", PRODUCTION)
# Load balancers probe these over plain HTTP inside the network.
SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^readyz$"]
SECURE_HSTS_SECONDS = env_int("DJANGO_SECURE_HSTS_SECONDS", 31_536_000 if PRODUCTION else 0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("DJANGO_SECURE_HSTS_INCLUDE_SUBDOMAINS", PRODUCTION)
SECURE_HSTS_PRELOAD = env_bool("DJANGO_SECURE_HSTS_PRELOAD", PRODUCTION)
SESSION_COOKIE_SECURE = env_bool("DJANGO_SECURE_COOKIES", PRODUCTION)
CSRF_COOKIE_SECURE = SESSION_COOKIE_SECURE
SESSION_COOKIE_HTTPONLY = True
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
SECURE_CROSS_ORIGIN_OPENER_POLICY = "same-origin"
X_FRAME_OPTIONS = "DENY"
# The web UI, everywhere (not only in production, so the tests and the browser
# test see the same policy): scripts and styles come from this origin or carry
# the response's nonce (templates: nonce="{{ request.csp_nonce }}"); no
# inline event handlers, no style attributes, no framing.
CONTENT_SECURITY_POLICY = {
    "DIRECTIVES": {
        "default-src": [SELF],
        "script-src": [SELF, NONCE],
        "style-src": [SELF, NONCE],
        "img-src": [SELF, "data:"],
        "font-src": [SELF],
        "connect-src": [SELF],
        "object-src": [NONE],
        "base-uri": [SELF],
        "form-action": [SELF],
        "frame-ancestors": [NONE],
    },
}

LOGGING_CONFIG = "llm_platform.log_format.logging_configure"
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "filters": {"request_context": {"()": "llm_platform.log_format.ContextFilter"}},
    "formatters": {
        "sluice": {
            "()": "llm_platform.log_format.JsonFormatter" if SLUICE_LOG_FORMAT == "json"
            else "llm_platform.log_format.PlainFormatter",
            # Scrubbed wherever they would appear (they never should).
            "secrets": [SECRET_KEY, SLUICE_METRICS_TOKEN],
        },
    },
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "sluice", "filters": ["request_context"]}},
    "root": {"handlers": ["console"], "level": LOG_LEVEL},
    "loggers": {
        "django.db.backends": {"level": "WARNING"},
        # django.request logs every 4xx at WARNING: a storm of 429s would be a
        # storm of log lines. 5xx stay (ERROR). /v1 has the access log instead.
        "django.request": {"level": "ERROR"},
        # uvicorn's own lines (start, stop, errors) in the same format; its
        # access log stays off (--no-access-log): sluice.access replaces it.
        "uvicorn": {"handlers": ["console"], "level": "INFO", "propagate": False},
        # Configuring "uvicorn" would otherwise revive its access logger.
        "uvicorn.access": {"handlers": [], "propagate": False},
        # Celery's per-task lines ("received", "succeeded") say less than the
        # request's own settlement line; its warnings and errors stay.
        "celery": {"level": "WARNING"},
        # Beat's "Sending due task" lines (a few a minute) show it is alive.
        "celery.beat": {"level": "INFO"},
        # The SDK's and httpx's per-call INFO lines, once per pool call.
        "httpx": {"level": "WARNING"},
        "openai": {"level": "WARNING"},
    },
}
