"""The connector follows an etcd that requires TLS client certificates and a password (``etcd_settings=``)."""

from __future__ import annotations

import dataclasses
import gc
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from cluster.etcd_process import enable_auth, make_certificates, start_etcd
from dkv.errors import ClusterError, ConfigError
from dkv.etcd import EtcdSettings
from tests.connector.conftest import device_blocks, routed_hint, two_leaves
from tests.connector.test_connector import chain, offload_chain

PREFIX = "/dkv-sec/"



@pytest.fixture(scope="module")
async def secure_etcd(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[EtcdSettings]:
    """etcd with TLS, client-certificate auth and user/password auth; the settings of its user ``dkv``."""
    base = tmp_path_factory.mktemp("secure-etcd")
    etcd = start_etcd(certificates=make_certificates(base / "ca"))
    try:
        password_file = await enable_auth(etcd.settings(), base / "auth", user="dkv", prefix=PREFIX)
        yield etcd.settings(user="dkv", password_file=password_file)
    finally:
        etcd.stop()


def _refused(connectors, address: str, **kwargs) -> tuple[type[Exception], str]:
    """The error a connector's construction raises (type and text: no gRPC objects kept by a traceback)."""
    try:
        connectors(address, **kwargs)
    except (ClusterError, ConfigError) as exc:
        return type(exc), str(exc)
    finally:
        gc.collect()
    pytest.fail("the connector was let in")


def test_a_connector_follows_a_secured_etcd_and_is_refused_without_its_credentials(
        secure_etcd: EtcdSettings, node_factory, connectors, tmp_path: Path) -> None:
    prefix = f"{PREFIX}{uuid.uuid4().hex[:12]}"
    node = node_factory(*secure_etcd.cli_args(), "--etcd-prefix", prefix, "--node-id", "a", "--etcd-ttl", "2")
    blocks = device_blocks(two_leaves())
    conn = connectors(node.address, blocks=blocks, etcd_settings=secure_etcd, etcd_prefix=prefix)
    hashes = chain(3)
    offload_chain(conn, blocks, hashes)
    hint = routed_hint(conn, hashes)  # the connector's router reads the secured directory
    assert json.loads(hint)["actions"][0]["payload"]["dkv"]["peer_id"] == "a"

    wrong = tmp_path / "wrong-password"
    wrong.write_text("not-the-password\n")
    cases = {
        "no client certificate": (dataclasses.replace(secure_etcd, cert_file=None, key_file=None),
                                  ClusterError, "TLS handshake failed"),
        "wrong password": (dataclasses.replace(secure_etcd, password_file=str(wrong)),
                           ClusterError, "refused the user name or password"),
        "no CA": (dataclasses.replace(secure_etcd, ca_file=None), ConfigError, "--etcd-ca"),
    }
    for case, (settings, kind, says) in cases.items():
        got, error = _refused(connectors, node.address, etcd_settings=settings, etcd_prefix=prefix)
        assert got is kind and says in error, f"{case}: {got.__name__}: {error}"
