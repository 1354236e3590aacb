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
    from django.conf import settings

    from gateway.core.lanes import LANES

    listed = (ROOT / ".env.example").read_text()
    for lane in LANES:
        assert settings.SLUICE_LANE_CONCURRENCY[lane.name] >= 1
        assert f"{lane.concurrency_env}=" in listed


def test_no_app_reads_the_environment_outside_settings():
    offenders = []
    for app in ("tenants", "budgets", "gateway"):
        for path in (ROOT / app).rglob("*.py"):
            if str(path.relative_to(ROOT)) in ALLOWED_ENVIRON_READS:
                continue
            if re.search(r"\bos\.(environ|getenv)\b", path.read_text()):
                offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []
