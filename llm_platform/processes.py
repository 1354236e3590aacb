"""The processes that make up a running platform, as command lines. Used by
`make run` (llm_platform.run) and by the test harness, so tests exercise the
same layout operators run: a web server, one worker pool per lane, beat and
the simulated pool."""

from __future__ import annotations

import os
import sys

# Worker threads per lane, sized by Little's law at each lane's design load
# (concurrency ~ 2 x arrival rate x time in system): interactive 20 req/s x
# ~1 s, interactive-long 2 req/s x ~4 s, batch 4 req/s x ~2 s, scheduled
# paced at ~1 req/s x ~4 s. Threads, not processes: a worker mostly waits on
# the pool's HTTP answer.
LANE_CONCURRENCY = {
    "interactive": 40,
    "interactive-long": 16,
    "batch": 16,
    "scheduled": 8,
}


def lane_concurrency(lane: str) -> int:
    env = f"SLUICE_WORKERS_{lane.upper().replace('-', '_')}"
    return int(os.environ.get(env, LANE_CONCURRENCY[lane]))


def sim_command(*, port: int, extra: list[str] | None = None) -> list[str]:
    return [sys.executable, "-m", "inference_sim", "--host", "127.0.0.1", "--port", str(port), *(extra or [])]


def web_command(*, port: int, host: str = "127.0.0.1", workers: int = 1) -> list[str]:
    return [
        sys.executable, "-m", "uvicorn", "llm_platform.asgi:application",
        "--host", host, "--port", str(port), "--workers", str(workers),
        "--no-access-log", "--timeout-keep-alive", "30",
    ]


def worker_command(*, lane: str, concurrency: int | None = None) -> list[str]:
    from llm_platform.celery import queue_for_lane

    return [
        sys.executable, "-m", "celery", "-A", "llm_platform", "worker",
        "-Q", queue_for_lane(lane), "-P", "threads", "-c", str(concurrency or lane_concurrency(lane)),
        "-n", f"{lane}@%h", "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "WARNING",
    ]


def beat_command(*, schedule_dir: str) -> list[str]:
    return [
        sys.executable, "-m", "celery", "-A", "llm_platform", "beat", "-S",
        "django_celery_beat.schedulers:DatabaseScheduler", "-l", "WARNING",
        "--pidfile", os.path.join(schedule_dir, "beat.pid"),
    ]
