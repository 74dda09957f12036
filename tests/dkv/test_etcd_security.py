"""etcd with TLS and client certificates, and etcd with user/password authentication, end to end.

Each half starts a real etcd secured one way (certificates made at test time with
``openssl``; authentication turned on through etcd's own API), a real node joins it
with the ``--etcd-*`` options, and the directory sees the node. Clients without the
credentials, or with the wrong CA, are refused with a :class:`ClusterError` (or a
:class:`ConfigError` before dialling) that says what to fix, within a bound.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from cluster.etcd_process import (
    EtcdCertificates,
    EtcdProcess,
    enable_auth,
    make_certificates,
    start_etcd,
)
from dkv.errors import ClusterError, ConfigError, DKVError
from dkv.etcd import EtcdSettings, Layout, make_client
from dkv.router import Router

BOUND = 30.0  # seconds any refusal may take: a refusal must never hang
AUTH_PREFIX = "/dkv-sec/"  # what the etcd user of the auth half may read and write



@dataclasses.dataclass
class TlsEtcd:
    etcd: EtcdProcess
    certs: EtcdCertificates
    other: EtcdCertificates  # a second CA, with its own client certificate: trusted by nobody here

    def settings(self, **changes: str | None) -> EtcdSettings:
        return dataclasses.replace(self.etcd.settings(), **changes)


@dataclasses.dataclass
class AuthEtcd:
    etcd: EtcdProcess
    password_file: Path

    def settings(self, **changes: str | None) -> EtcdSettings:
        return dataclasses.replace(self.etcd.settings(user="dkv", password_file=self.password_file), **changes)


@pytest.fixture(scope="module")
def tls_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsEtcd]:
    base = tmp_path_factory.mktemp("etcd-tls")
    certs = make_certificates(base / "ca")
    other = make_certificates(base / "other-ca")
    etcd = start_etcd(certificates=certs)  # --cert-file --key-file --trusted-ca-file --client-cert-auth
    try:
        yield TlsEtcd(etcd, certs, other)
    finally:
        etcd.stop()


@pytest.fixture(scope="module")
async def auth_etcd(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[AuthEtcd]:
    etcd = start_etcd()
    try:
        password_file = await enable_auth(etcd.settings(), tmp_path_factory.mktemp("etcd-auth"), user="dkv",
                                          prefix=AUTH_PREFIX)
        yield AuthEtcd(etcd, password_file)
    finally:
        etcd.stop()


def _prefix() -> str:
    return f"{AUTH_PREFIX}{uuid.uuid4().hex[:12]}"


def _node_args(settings: EtcdSettings, prefix: str, node_id: str) -> tuple[str, ...]:
    return (*settings.cli_args(), "--etcd-prefix", prefix, "--node-id", node_id, "--etcd-ttl", "2")


async def _sees(settings: EtcdSettings, prefix: str, node_id: str) -> dict:
    """The member record the directory (a router on ``settings``) holds for ``node_id``, waited for (bounded)."""
    client = make_client(settings)
    await client.connect()
    router = Router(client, Layout(prefix=prefix))
    try:
        await router.start(follow=True)
        assert await router.wait_until(lambda r: node_id in r.members, BOUND), f"{node_id} never showed up"
        return vars(router.members[node_id])
    finally:
        await router.stop()
        await client.close()


async def _refusal(settings: EtcdSettings) -> tuple[type[DKVError], str]:
    """What a client on ``settings`` gets when it reads the directory: it must be refused, within BOUND.

    Returns the error's type and text only: a kept traceback would keep gRPC's objects (and its poller) alive.
    """
    async def read() -> None:
        client = make_client(settings)
        await client.connect()
        router = Router(client, Layout(prefix=_prefix()))
        try:
            await router.start(follow=False)
        finally:
            await router.stop()
            await client.close()

    try:
        await asyncio.wait_for(read(), BOUND)
    except DKVError as exc:
        return type(exc), str(exc)
    finally:
        gc.collect()
    pytest.fail(f"a client on {settings.describe()} was let in")


def _dkv(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dkv.cli", *args], capture_output=True, text=True,
                          timeout=BOUND + 30, env={**os.environ, **(env or {})}, check=False)


def _node_refused(settings: EtcdSettings, tmp_path: Path) -> str:
    """A node on ``settings`` must refuse to start (exit 2), saying why; returns what it printed on stderr."""
    ready = tmp_path / f"ready-{uuid.uuid4().hex[:6]}.json"
    result = _dkv("serve", "--listen", "127.0.0.1:0", "--pool", "8MiB", "--ready-file", str(ready),
                  "--exit-with-parent", *_node_args(settings, _prefix(), "refused"))
    assert result.returncode == 2 and not ready.exists(), (result.returncode, result.stderr[-2000:])
    return " ".join(result.stderr.split())


# ---- TLS with client certificates --------------------------------------------------------------


async def test_a_node_joins_a_tls_etcd_with_its_client_certificate(tls_etcd: TlsEtcd, node_factory) -> None:
    settings = tls_etcd.settings()
    assert settings.endpoints.startswith("https://")
    prefix = _prefix()
    node = node_factory(*_node_args(settings, prefix, "tls-a"))
    assert (await _sees(settings, prefix, "tls-a"))["address"] == node.address
    # the inspection commands take the same settings, here from the environment
    env = {"DKV_ETCD": settings.endpoints, "DKV_ETCD_CA": str(tls_etcd.certs.ca),
           "DKV_ETCD_CERT": str(tls_etcd.certs.client_cert), "DKV_ETCD_KEY": str(tls_etcd.certs.client_key)}
    peers = _dkv("peers", "--etcd-prefix", prefix, "--json", env=env)
    assert peers.returncode == 0, peers.stderr[-2000:]
    assert [p["node_id"] for p in json.loads(peers.stdout)] == ["tls-a"]


async def test_tls_etcd_refuses_clients_without_the_right_certificates(tls_etcd: TlsEtcd, tmp_path: Path) -> None:
    url, port = tls_etcd.etcd.url, tls_etcd.etcd.client_port
    other = tls_etcd.other
    # no CA for an https:// endpoint: refused before dialling, saying which option is missing
    with pytest.raises(ConfigError, match="--etcd-ca"):
        make_client(EtcdSettings(url))
    cases = {
        "plain http": (EtcdSettings(f"http://127.0.0.1:{port}"), "https://"),
        "no client certificate": (tls_etcd.settings(cert_file=None, key_file=None), "TLS handshake failed"),
        "wrong CA": (tls_etcd.settings(ca_file=str(other.ca)), "TLS handshake failed"),
        "certificate of another CA": (tls_etcd.settings(cert_file=str(other.client_cert),
                                                        key_file=str(other.client_key)), "TLS handshake failed"),
    }
    for case, (settings, says) in cases.items():
        kind, error = await _refusal(settings)
        assert kind is ClusterError, f"{case}: {kind.__name__}: {error}"
        assert says in error and "--etcd-ca" in error, f"{case}: {error}"
    # a node with the wrong CA does not start, and says why
    assert "TLS handshake failed" in _node_refused(tls_etcd.settings(ca_file=str(other.ca)), tmp_path)
    # and the CLI says it in one line
    peers = _dkv("peers", *tls_etcd.settings(ca_file=str(other.ca)).cli_args())
    assert peers.returncode == 2 and "TLS handshake failed" in peers.stderr, peers.stderr[-2000:]


# ---- user/password authentication --------------------------------------------------------------


async def test_a_node_joins_an_etcd_with_authentication(auth_etcd: AuthEtcd, node_factory) -> None:
    settings = auth_etcd.settings()
    password = auth_etcd.password_file.read_text().strip()
    prefix = _prefix()
    node = node_factory(*_node_args(settings, prefix, "auth-a"))
    assert (await _sees(settings, prefix, "auth-a"))["address"] == node.address
    cmdline = Path(f"/proc/{node.pid}/cmdline").read_bytes()
    assert password.encode() not in cmdline, "the password must come from its file, never the command line"
    peers = _dkv("peers", "--etcd-prefix", prefix, "--json", *settings.cli_args())
    assert peers.returncode == 0, peers.stderr[-2000:]
    assert [p["node_id"] for p in json.loads(peers.stdout)] == ["auth-a"]


async def test_etcd_with_authentication_refuses_clients_without_the_password(auth_etcd: AuthEtcd,
                                                                             tmp_path: Path) -> None:
    wrong = tmp_path / "wrong-password"
    wrong.write_text("not-the-password\n")
    no_user = auth_etcd.settings(user=None, password_file=None)
    kind, error = await _refusal(no_user)
    assert kind is ClusterError and "requires authentication" in error and "--etcd-user" in error, error
    kind, error = await _refusal(auth_etcd.settings(password_file=str(wrong)))
    assert kind is ClusterError and "refused the user name or password" in error, error
    # a user without a password file is refused before dialling
    with pytest.raises(ConfigError, match="--etcd-password-file"):
        make_client(auth_etcd.settings(password_file=None))
    # nodes without the credentials do not start, and say why
    assert "requires authentication" in _node_refused(no_user, tmp_path)
    assert "refused the user name or password" in _node_refused(auth_etcd.settings(password_file=str(wrong)),
                                                                tmp_path)


# ---- the settings themselves (no etcd) ---------------------------------------------------------


def test_settings_say_what_is_wrong_before_dialling(tmp_path: Path) -> None:
    ca, cert, key, password = (tmp_path / n for n in ("ca.crt", "client.crt", "client.key", "password"))
    for path in (ca, cert, key):
        path.write_text("PEM")
    password.write_text("s3cret\n")
    refusals = {
        "mixed schemes": (EtcdSettings("http://a:1,https://b:2", ca_file=str(ca)), "mix http:// and https://"),
        "TLS files for http://": (EtcdSettings("http://a:1", ca_file=str(ca)), "use https://"),
        "https:// without a CA": (EtcdSettings("https://a:1"), "--etcd-ca"),
        "certificate without key": (EtcdSettings("https://a:1", ca_file=str(ca), cert_file=str(cert)), "--etcd-key"),
        "unreadable CA": (EtcdSettings("https://a:1", ca_file=str(tmp_path / "none")), "cannot read"),
        "user without password": (EtcdSettings("http://a:1", user="dkv"), "--etcd-password-file"),
        "password without user": (EtcdSettings("http://a:1", password_file=str(password)), "--etcd-user"),
    }
    for case, (settings, says) in refusals.items():
        with pytest.raises(ConfigError, match=says.replace("/", "/")) as info:
            settings.validate()
        assert says in str(info.value), case
    ok = EtcdSettings("https://a:1", ca_file=str(ca), cert_file=str(cert), key_file=str(key), user="dkv",
                      password_file=str(password)).validate()
    assert ok.read_password() == "s3cret" and ok.tls
    assert "s3cret" not in repr(ok) and "s3cret" not in " ".join(ok.cli_args())
    assert "s3cret" not in repr(dataclasses.replace(ok, password="s3cret"))


def test_settings_from_the_environment(tmp_path: Path) -> None:
    env = {"DKV_ETCD": "https://10.0.0.2:2379", "DKV_ETCD_CA": "/ca.crt", "DKV_ETCD_CERT": "/c.crt",
           "DKV_ETCD_KEY": "/c.key", "DKV_ETCD_USER": "dkv", "DKV_ETCD_PASSWORD_FILE": "/pw"}
    settings = EtcdSettings.from_env(environ=env)
    assert (settings.endpoints, settings.ca_file, settings.cert_file, settings.key_file, settings.user,
            settings.password_file) == ("https://10.0.0.2:2379", "/ca.crt", "/c.crt", "/c.key", "dkv", "/pw")
    assert EtcdSettings.from_env("https://other:1", environ=env).endpoints == "https://other:1"
    with pytest.raises(ConfigError, match="DKV_ETCD"):
        EtcdSettings.from_env(environ={})
