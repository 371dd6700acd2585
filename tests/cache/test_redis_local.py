"""The test-side Redis helpers: a cluster node whose bus port another process took starts on
another port pair instead of failing the test run."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from replaykv.cache.redis_local import REDIS_BIN, RedisClusterNodes, free_cluster_port


def test_a_cluster_node_moves_off_a_taken_bus_port(tmp_path: Path) -> None:
    if REDIS_BIN is None:
        pytest.fail("redis-server must be on PATH: `make test` (scripts/test.sh) installs it")
    nodes = RedisClusterNodes(REDIS_BIN, tmp_path)
    node = nodes.nodes[0]
    taken = free_cluster_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", taken + 10000))
        holder.listen()
        node.port = taken
        try:
            nodes._start_node(node)
            assert node.port != taken
            assert "Address already in use" in (node.workdir / "redis.0.log").read_text()
        finally:
            node.kill()
