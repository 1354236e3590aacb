"""docker/ is written for users and checked by parsing here (no Docker engine
on CI): the compose file names a worker per lane consuming exactly that lane's
queue, and every path the Dockerfile copies exists."""

from __future__ import annotations

from pathlib import Path

import yaml

from gateway.core.lanes import LANES

ROOT = Path(__file__).resolve().parents[2]


def test_compose_has_every_part_of_the_platform():
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    services = compose["services"]
    assert {"postgres", "redis", "web", "beat", "pacer", "sim", "migrate"} <= set(services)
    assert services["pacer"]["command"][-1] == "run_pacer"
    for lane, queue in ((lane.name, lane.queue) for lane in LANES):
        command = services[f"worker-{lane}"]["command"]
        assert command[command.index("-Q") + 1] == queue
        assert command[command.index("-n") + 1].startswith(f"{lane}@")
    assert "llm_platform.asgi:application" in services["web"]["command"]


def test_dockerfile_copies_only_paths_that_exist():
    lines = (ROOT / "docker" / "Dockerfile").read_text().splitlines()
    copies = [line.split()[1:-1] for line in lines if line.startswith("COPY ")]
    assert copies
    for sources in copies:
        for source in sources:
            assert (ROOT / source).exists(), source


def test_the_image_installs_from_the_lock_and_copies_every_package():
    # given the packages pyproject.toml ships and the Dockerfile's lines
    import re
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    shipped = {pattern.rstrip("*") for pattern in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    lines = (ROOT / "docker" / "Dockerfile").read_text().splitlines()
    copied = {source for line in lines if line.startswith("COPY ") for source in line.split()[1:-1]}
    # then every shipped package is copied, and packages come from the lock with their hashes
    assert shipped <= copied
    assert any(re.search(r"pip install .*--require-hashes .*-r requirements\.lock", line) for line in lines)
