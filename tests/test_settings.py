"""Settings live in one place: llm_platform/settings.py reads the environment,
every variable it reads is listed in .env.example, and no app module reads
the environment on its own."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Read outside settings.py on purpose: a pool's API key lives in the variable
# its InferencePool.api_key_env names (a secret never stored in the database).
ALLOWED_ENVIRON_READS = {"gateway/worker/pool_client.py"}


def _environment_reads(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = ast.unparse(node.func)
            if func in {"os.environ.get", "os.getenv", "env_bool", "env_int", "env_float"} and \
                    isinstance(node.args[0].value, str):
                names.add(node.args[0].value)
    return names


def test_every_variable_settings_reads_is_in_env_example():
    listed = set(re.findall(r"^#?\s*([A-Z][A-Z0-9_]+)=", (ROOT / ".env.example").read_text(), flags=re.M))
    read = _environment_reads(ROOT / "llm_platform" / "settings.py")
    assert read and not read - listed


def test_lane_worker_counts_are_settings_with_their_variable_listed():
    from gateway.core.lanes import LANES, lane_concurrency

    listed = (ROOT / ".env.example").read_text()
    for lane in LANES:
        assert lane_concurrency(lane.name) >= 1
        assert f"{lane.concurrency_env}=" in listed


def test_lane_process_counts_are_settings_with_their_variable_listed():
    from django.conf import settings

    from gateway.core.lanes import LANES

    listed = (ROOT / ".env.example").read_text()
    for lane in LANES:
        assert settings.SLUICE_LANE_PROCESSES[lane.name] >= 1
        assert f"{lane.processes_env}=" in listed


def test_a_lanes_threads_are_split_over_its_processes_each_its_own_celery_node(settings):
    from llm_platform.processes import lane_worker_commands

    # given: the interactive lane on three processes, the long lane on one
    settings.SLUICE_LANE_PROCESSES = {"interactive": 3, "interactive-long": 1}
    settings.SLUICE_LANE_CONCURRENCY = {"interactive": 40, "interactive-long": 16}

    # when
    interactive = lane_worker_commands("interactive")
    long = lane_worker_commands("interactive-long")

    # then: 40 threads as 14 + 14 + 14 (rounded up), distinct node names on the lane's one queue
    def option(command, flag):
        return command[command.index(flag) + 1]

    assert [node for node, _ in interactive] == ["interactive", "interactive-2", "interactive-3"]
    assert [option(c, "-c") for _, c in interactive] == ["14", "14", "14"]
    assert {option(c, "-Q") for _, c in interactive} == {"interactive"}
    assert [option(c, "-n") for _, c in interactive] == ["interactive@%h", "interactive-2@%h", "interactive-3@%h"]
    assert [(node, option(c, "-c"), option(c, "-n")) for node, c in long] == [
        ("interactive-long", "16", "interactive-long@%h")]


def test_no_app_reads_the_environment_outside_settings():
    offenders = []
    for app in ("tenants", "budgets", "gateway"):
        for path in (ROOT / app).rglob("*.py"):
            if str(path.relative_to(ROOT)) in ALLOWED_ENVIRON_READS:
                continue
            if re.search(r"\bos\.(environ|getenv)\b", path.read_text()):
                offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []


# --- production settings ---------------------------------------------------------------

import os  # noqa: E402
import secrets  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402


def _manage(args: list[str], *, tmp_path: Path, **environment: str) -> subprocess.CompletedProcess:
    """``manage.py`` in a fresh process with only the environment given (plus
    the database and Redis of this run): no PYTEST_VERSION, so the tests' own
    secret key does not apply."""
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "SLUICE_VAR_DIR": str(tmp_path / "var"),
           "DATABASE_URL": os.environ.get("DATABASE_URL", ""), "REDIS_URL": os.environ.get("REDIS_URL", ""),
           **environment}
    return subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def test_check_deploy_is_clean_with_the_production_environment(tmp_path):
    result = _manage(["check", "--deploy", "--fail-level", "WARNING"], tmp_path=tmp_path, SLUICE_ENV="production",
                     DJANGO_SECRET_KEY=secrets.token_urlsafe(50), DJANGO_SECURE_PROXY_SSL_HEADER="X-Forwarded-Proto")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "System check identified no issues (0 silenced)."


def test_the_local_environment_is_not_mistaken_for_a_deployable_one(tmp_path):
    result = _manage(["check", "--deploy", "--fail-level", "WARNING"], tmp_path=tmp_path,
                     DJANGO_SECRET_KEY=secrets.token_urlsafe(50))
    assert result.returncode != 0
    for warning in ("security.W004", "security.W008", "security.W012", "security.W016"):  # HSTS, redirect, cookies
        assert warning in result.stderr, warning


def test_the_secret_key_is_required_outside_make_run_and_the_tests(tmp_path):
    # without one: a clear message, and nothing starts
    missing = _manage(["check"], tmp_path=tmp_path)
    assert missing.returncode != 0
    assert "DJANGO_SECRET_KEY is not set" in missing.stderr
    # the key `make run` writes serves local commands beside it...
    from llm_platform.processes import local_secret_key

    key = local_secret_key(tmp_path / "var")
    assert len(key) >= 50 and local_secret_key(tmp_path / "var") == key  # made once, then kept
    assert (tmp_path / "var" / "secret_key").stat().st_mode & 0o077 == 0  # its owner's only
    assert _manage(["check"], tmp_path=tmp_path).returncode == 0
    # ...never production, which needs its own
    production = _manage(["check"], tmp_path=tmp_path, SLUICE_ENV="production")
    assert production.returncode != 0 and "DJANGO_SECRET_KEY is not set" in production.stderr


@pytest.mark.parametrize("environment, message", [
    ({"SLUICE_ENV": "prod"}, "SLUICE_ENV must be 'local' or 'production'"),
    ({"SLUICE_ENV": "production", "DJANGO_DEBUG": "true"}, "would show tracebacks"),
])
def test_unsafe_or_unknown_environments_are_refused(tmp_path, environment, message):
    result = _manage(["check"], tmp_path=tmp_path, DJANGO_SECRET_KEY=secrets.token_urlsafe(50), **environment)
    assert result.returncode != 0 and message in result.stderr


# --- the web UI under its Content-Security-Policy ----------------------------------------

INLINE_SCRIPT = re.compile(r"<script(?![^>]*\b(?:src|nonce)=)[^>]*>", re.I)
INLINE_STYLE = re.compile(r"<style(?![^>]*\bnonce=)[^>]*>", re.I)
STYLE_ATTRIBUTE = re.compile(r"\sstyle\s*=", re.I)
EVENT_HANDLER = re.compile(r"\son[a-z]+\s*=", re.I)


def test_templates_keep_no_inline_code_the_policy_would_block():
    offenders = []
    for path in sorted((ROOT / "templates").rglob("*.html")):
        text = path.read_text()
        for name, pattern in (("inline script", INLINE_SCRIPT), ("inline style", INLINE_STYLE),
                              ("style attribute", STYLE_ATTRIBUTE), ("event handler", EVENT_HANDLER)):
            if pattern.search(text) or "javascript:" in text:
                offenders.append(f"{path.relative_to(ROOT)}: {name}")
    assert offenders == []


@pytest.mark.django_db
def test_pages_carry_the_policy_and_their_inline_style_its_nonce():
    from django.test import Client

    response = Client().get("/accounts/login/")
    policy = response["Content-Security-Policy"]
    nonce = re.search(r"'nonce-([^']+)'", policy).group(1)
    assert "default-src 'self'" in policy and "frame-ancestors 'none'" in policy and "object-src 'none'" in policy
    assert f"script-src 'self' 'nonce-{nonce}'" in policy and f"style-src 'self' 'nonce-{nonce}'" in policy
    assert "unsafe-inline" not in policy
    assert f'<style nonce="{nonce}">' in response.content.decode()
    assert response["X-Frame-Options"] == "DENY"
    assert response["Referrer-Policy"] == "same-origin"


def test_the_redis_down_page_reloads_itself_without_a_script():
    from django.test import RequestFactory

    from budgets.errors import BudgetUnavailable
    from llm_platform.degraded import StoreUnavailableMiddleware

    request = RequestFactory().get("/ops/pools/")
    request.csp_nonce = "n0nce"
    response = StoreUnavailableMiddleware(lambda r: None).process_exception(request, BudgetUnavailable("down"))
    page = response.content.decode()
    assert response.status_code == 503 and response["Retry-After"] == "5"
    assert '<meta http-equiv="refresh" content="5">' in page
    assert "<script" not in page and '<style nonce="n0nce">' in page


def test_a_postgresql_that_never_answers_fails_the_connection_instead_of_hanging():
    import socket
    import threading
    import time

    import psycopg
    from django.db import connection

    # given a listener that completes TCP handshakes and never says a word
    # (a hung server), and the connection parameters settings.py gives
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    params = {**connection.get_connection_params(), "host": "127.0.0.1", "port": listener.getsockname()[1]}
    # (the wait's end if nothing bounded it: the listener goes after 20 s)
    closer = threading.Timer(20, listener.close)
    closer.start()
    started = time.monotonic()
    try:
        # when a connection is opened to it
        with pytest.raises(psycopg.OperationalError):
            psycopg.connect(**params)
        waited = time.monotonic() - started
    finally:
        closer.cancel()
        listener.close()
    # then it fails after DB_CONNECT_TIMEOUT_S (5 s), not when the host gives up
    assert params["connect_timeout"] == 5 and params["tcp_user_timeout"] == 30_000
    assert 4 <= waited < 15


@pytest.mark.django_db(transaction=True)
def test_a_statement_waiting_on_a_lock_fails_after_db_lock_timeout(tmp_path):
    import psycopg

    from tenants.models import Tenant
    from tests.conftest import _database_url

    # given a table locked by another connection (a migration's lock)
    locker = psycopg.connect(_database_url(), autocommit=False)
    code = ("import time\nfrom django.db import OperationalError\nfrom tenants.models import Tenant\n"
            "started = time.monotonic()\ntry:\n    Tenant.objects.count()\n    print('answered')\n"
            "except OperationalError as exc:\n    print(type(exc.__cause__).__name__, round(time.monotonic() - started, 1))")
    try:
        locker.execute(f"LOCK TABLE {Tenant._meta.db_table} IN ACCESS EXCLUSIVE MODE")
        # when a process with DB_LOCK_TIMEOUT_S=0.5 reads it
        result = _manage(["shell", "-c", code], tmp_path=tmp_path, DATABASE_URL=_database_url(),
                         DB_LOCK_TIMEOUT_S="0.5", DJANGO_SECRET_KEY=secrets.token_urlsafe(50))
    finally:
        locker.rollback()
        locker.close()
    # then its statement fails with the server's lock timeout within about that, not when the lock goes
    assert result.returncode == 0, result.stdout + result.stderr
    name, waited = result.stdout.split()[-2:]
    assert name == "LockNotAvailable" and float(waited) < 5
    # and with 0 no bound is asked for (no startup options: what a pooler refuses)
    shown = _manage(["shell", "-c", "from django.db import connection; print(connection.get_connection_params())"],
                    tmp_path=tmp_path, DATABASE_URL=_database_url(), DB_LOCK_TIMEOUT_S="0",
                    DJANGO_SECRET_KEY=secrets.token_urlsafe(50))
    assert shown.returncode == 0 and "'connect_timeout': 5" in shown.stdout and "options" not in shown.stdout


@pytest.mark.django_db
def test_the_default_lock_timeout_reaches_the_server():
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SHOW lock_timeout")
        assert cursor.fetchone()[0] == "10s"
