"""`dkv cluster up --etcd-tls --etcd-auth`: etcd with client certificates and a password, the nodes given both."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path




def _dkv(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dkv.cli", *args], capture_output=True, text=True,
                          timeout=timeout, check=False)


def test_cluster_up_with_etcd_tls_and_auth_hands_the_settings_to_its_nodes(tmp_path: Path) -> None:
    directory = tmp_path / "c"
    up = _dkv("cluster", "up", "--nodes", "2", "--dir", str(directory), "--pool", "16MiB", "--etcd-tls", "--etcd-auth")
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        record = json.loads((directory / "cluster.json").read_text())
        assert record["etcd_url"].startswith("https://")
        security = record["etcd_security"]
        assert security["user"] == "dkv" and Path(security["password_file"]).exists()
        for secret in (security["password_file"], security["key_file"]):
            assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600, secret
        # every node registered (up waits for it; status reads etcd with the recorded settings)
        status = _dkv("cluster", "status", "--dir", str(directory), "--json")
        assert status.returncode == 0, status.stderr[-2000:]
        info = json.loads(status.stdout)
        assert len(info["nodes"]) == 2 and all(n["registered"] for n in info["nodes"]), info
        # up prints how to inspect it, with the options it needs
        assert "--etcd-ca" in up.stdout and "--etcd-password-file" in up.stdout
        peers = _dkv("peers", "--etcd", record["etcd_url"], "--etcd-ca", security["ca_file"],
                     "--etcd-cert", security["cert_file"], "--etcd-key", security["key_file"],
                     "--etcd-user", "dkv", "--etcd-password-file", security["password_file"], "--json")
        assert peers.returncode == 0, peers.stderr[-2000:]
        assert sorted(p["node_id"] for p in json.loads(peers.stdout)) == ["node-0", "node-1"]
        # without the client certificate etcd refuses, and the CLI says what is missing
        bare = _dkv("peers", "--etcd", record["etcd_url"], "--etcd-ca", security["ca_file"])
        assert bare.returncode == 2 and "--etcd-cert" in bare.stderr, bare.stderr[-2000:]
    finally:
        down = _dkv("cluster", "down", "--dir", str(directory))
    assert down.returncode == 0, down.stderr
    assert sorted(p.name for p in directory.iterdir()) == ["etcd.log", "node-0.log", "node-1.log"], \
        "down removes the certificates and the password files"
