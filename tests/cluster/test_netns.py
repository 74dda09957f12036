"""The end-to-end test across network namespaces: a real network stack between every process (root)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cluster import local
from cluster.netns import NETNS_ENV, netns_available

CLIENT = Path(__file__).with_name("netns_client.py")
ROOT = Path(__file__).resolve().parents[2]


def test_prefix_loads_from_a_peer_across_network_namespaces_bit_exact(tmp_path: Path) -> None:
    reason = netns_available()
    if reason:
        print(f"skipped: {reason}")
        pytest.skip(reason)
    before = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
    record = local.up(tmp_path / "c", 3, pool="32MiB", netns=True)
    try:
        assert all(not n.address.startswith("127.") for n in record.nodes)
        env = {**os.environ, **NETNS_ENV, "PYTHONPATH": str(ROOT)}
        result = subprocess.run([*record.client_prefix(), sys.executable, str(CLIENT), str(tmp_path / "c")],
                                capture_output=True, text=True, timeout=240, env=env)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
        report = json.loads(result.stdout.strip().splitlines()[-1])
    finally:
        local.down(tmp_path / "c")
    assert report["peer"] == "node-0" and report["peer_address"] == record.nodes[0].address
    assert report["hits_peer"] == 1 and report["connector_hit_blocks"] > 0
    assert report["shared_memory_used"] is False, "across namespaces the bytes must cross the network stack"
    assert report["bit_exact"] is True
    after = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
    assert not {n for n in after - before if n.startswith("dkv")}, "the cluster's namespaces must be gone"
