"""A real Redis Cluster for tests: ``redis-server --cluster-enabled yes`` nodes on free ports
(at most 55535: the cluster bus listens on port + 10000) in a temporary directory, joined with
``redis-cli --cluster create``, stopped after.

Nodes run as the docs recommend (docs/deploy.md): ``cluster-require-full-coverage no``, so the
other masters go on serving their slots while one shard has no master, and a short node timeout
so that a failover takes seconds, not the default fifteen.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis
from stats.redis_support import RedisServer

REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"
BUS_OFFSET = 10_000
MAX_PORT = 65_535 - BUS_OFFSET
NODE_TIMEOUT_MS = 1000


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_cluster_port(taken: set[int]) -> int:
    """A port whose cluster bus port (+10000) is free too, at most 55535."""
    for _ in range(1000):
        port = random.randint(20_000, MAX_PORT)
        if port in taken or port + BUS_OFFSET in taken:
            continue
        if _bindable(port) and _bindable(port + BUS_OFFSET):
            return port
    raise RuntimeError("no free port pair for a cluster node")


class LocalCluster:
    """``masters`` masters with ``replicas`` replicas each, on loopback; restartable nodes."""

    def __init__(self, directory: Path, masters: int = 3, replicas: int = 0) -> None:
        self.directory = directory
        self.replicas = replicas
        taken: set[int] = set()
        self.nodes: dict[int, RedisServer] = {}
        for _ in range(masters * (1 + replicas)):
            port = free_cluster_port(taken)
            taken |= {port, port + BUS_OFFSET}
            # fmt: off
            args = [
                "--cluster-enabled", "yes",
                "--cluster-config-file", f"nodes-{port}.conf",
                "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
                "--cluster-require-full-coverage", "no",
                # (a replica takes over however long ago it last heard its master)
                "--cluster-replica-validity-factor", "0",
            ]
            # fmt: on
            self.nodes[port] = RedisServer(directory / str(port), port, args)

    @property
    def ports(self) -> list[int]:
        return list(self.nodes)

    @property
    def url(self) -> str:
        """The URL of one node (what ``ADV_REDIS_URL`` names)."""
        return self.nodes[self.ports[0]].url

    def client(self, port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=5)

    def start(self, timeout: float = 60.0) -> None:
        for node in self.nodes.values():
            node.start()
        # fmt: off
        create = [
            REDIS_CLI, "--cluster", "create",
            *(f"127.0.0.1:{port}" for port in self.ports),
            "--cluster-replicas", str(self.replicas), "--cluster-yes",
        ]
        # fmt: on
        done = subprocess.run(create, capture_output=True, timeout=timeout, check=False)
        if done.returncode != 0:
            self.stop()
            raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout!r}")
        self.wait_ok(timeout)

    def _info(self, port: int, section: str) -> dict[str, str]:
        with self.client(port) as client:
            text = client.execute_command("CLUSTER INFO" if section == "cluster" else "INFO")
        if isinstance(text, bytes):
            text = text.decode()
        if isinstance(text, dict):
            return {k: str(v) for k, v in text.items()}
        return dict(line.split(":", 1) for line in text.split() if ":" in line)

    def ok(self, port: int) -> bool:
        try:
            info = self._info(port, "cluster")
        except (redis.RedisError, OSError):
            return False
        return info.get("cluster_state") == "ok" and info.get("cluster_slots_ok") == "16384"

    def wait_ok(self, timeout: float = 60.0) -> None:
        """Until every running node says the cluster is ok and every replica is in sync."""
        deadline = time.monotonic() + timeout
        running = [p for p, n in self.nodes.items() if n.process is not None]
        while not all(self.ok(p) for p in running) or not self._replicas_synced(running):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster did not become ok in {timeout} s")
            time.sleep(0.1)

    def _replicas_synced(self, running: list[int]) -> bool:
        for port in running:
            with self.client(port) as client:
                info = client.info("replication")
            if info.get("role") == "slave" and info.get("master_link_status") != "up":
                return False
        return True

    def masters(self) -> dict[int, list[tuple[int, int]]]:
        """Running masters: port -> their slot ranges (as the cluster says now)."""
        port = next(p for p, n in self.nodes.items() if n.process is not None)
        with self.client(port) as client:
            slots = client.execute_command("CLUSTER SLOTS")
        out: dict[int, list[tuple[int, int]]] = {}
        for start, end, master, *_ in slots:
            out.setdefault(int(master[1]), []).append((int(start), int(end)))
        return out

    def master_of(self, slot: int) -> int:
        for port, ranges in self.masters().items():
            if any(a <= slot <= b for a, b in ranges):
                return port
        raise KeyError(slot)

    def flush(self) -> None:
        """Empty every master (their replicas follow)."""
        for port in self.masters():
            with self.client(port) as client:
                client.flushall()

    def kill(self, port: int) -> None:
        self.nodes[port].kill()

    def restart(self, port: int) -> None:
        """Start a killed node again on its port: it rejoins (as a replica once its slots
        failed over) from its nodes.conf."""
        self.nodes[port].start()

    def stop(self) -> None:
        for node in self.nodes.values():
            node.stop()


__all__ = ["LocalCluster", "free_cluster_port"]
