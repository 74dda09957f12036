"""Start and stop a real ``etcd`` process on free loopback ports (tests, local clusters).

The data directory lives under ``/dev/shm`` by default (etcd is ready in well
under a second there). :meth:`EtcdProcess.stop` kills it by PID and, unless
``keep_data`` is asked for, removes the data directory. With
:func:`make_certificates` (a private CA made with ``openssl``) etcd serves TLS
and requires client certificates; :func:`enable_auth` turns on user/password
authentication.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cluster.process import listening_on

if TYPE_CHECKING:
    from dkv.etcd import EtcdSettings

READY_TIMEOUT = 30.0
FIXED_PORT_PAUSE = 1.0  # seconds between attempts to restart etcd on ports another process holds


class EtcdNotFound(RuntimeError):
    """No ``etcd`` binary on PATH."""


def etcd_binary() -> str:
    """Path of the ``etcd`` binary, or :class:`EtcdNotFound` naming the package that provides it."""
    path = shutil.which("etcd")
    if path is None:
        raise EtcdNotFound("etcd is not on PATH: install it (Debian/Ubuntu: apt-get install etcd-server)")
    return path


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now on ``host`` (the caller binds it soon; a clash makes the start fail and retry)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass
class EtcdProcess:
    """A running etcd member."""

    proc: subprocess.Popen[bytes]
    client_port: int
    peer_port: int
    data_dir: Path
    log_path: Path
    host: str = "127.0.0.1"
    certificates: EtcdCertificates | None = None  # TLS on the client port (with client-certificate auth)
    client_cert_auth: bool = True

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def url(self) -> str:
        return f"{'https' if self.certificates else 'http'}://{self.endpoint}"

    def settings(self, *, client_cert: bool = True, user: str | None = None,
                 password_file: Path | str | None = None) -> EtcdSettings:
        """How a dKV client reaches this etcd: its URL, and with TLS its CA and (``client_cert``) the client pair."""
        from dkv.etcd import EtcdSettings

        certs = self.certificates
        return EtcdSettings(
            self.url,
            ca_file=str(certs.ca) if certs else None,
            cert_file=str(certs.client_cert) if certs and client_cert else None,
            key_file=str(certs.client_key) if certs and client_cert else None,
            user=user,
            password_file=str(password_file) if password_file else None,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, keep_data: bool = False, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL if needed; remove the data directory unless ``keep_data``."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        if not keep_data:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self.log_path.unlink(missing_ok=True)

    def restart(self) -> EtcdProcess:
        """Start etcd again on the same ports and data (after :meth:`stop` with ``keep_data``)."""
        return start_etcd(data_dir=self.data_dir, client_port=self.client_port, peer_port=self.peer_port,
                          log_path=self.log_path, host=self.host, certificates=self.certificates,
                          client_cert_auth=self.client_cert_auth)


@dataclass(frozen=True)
class EtcdCertificates:
    """PEM files of a private CA, etcd's server certificate and a client certificate (keys are mode 0600).

    Made with the ``openssl`` command line (:func:`make_certificates`): for tests and
    local clusters, not a production PKI.
    """

    directory: Path
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    binary = shutil.which("openssl")
    if binary is None:
        raise RuntimeError("openssl is not on PATH: install it (Debian/Ubuntu: apt-get install openssl)")
    result = subprocess.run([binary, *args], cwd=cwd, capture_output=True, text=True, timeout=60,
                            stdin=subprocess.DEVNULL, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {result.stderr.strip()[-500:]}")


def make_certificates(directory: Path, *, hosts: tuple[str, ...] = ("127.0.0.1", "localhost"),
                      client_name: str = "dkv", days: int = 30) -> EtcdCertificates:
    """A fresh CA (``ca.crt``), a server certificate for ``hosts`` and a client certificate named ``client_name``.

    ``directory`` is created mode 0700; the CA's key is deleted once both certificates are signed.
    """
    directory = Path(directory)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    directory.chmod(0o700)
    old_umask = os.umask(0o077)  # keys are written 0600
    try:
        ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
        _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", str(days),
                 "-subj", "/CN=dkv etcd CA", "-addext", "basicConstraints=critical,CA:TRUE",
                 "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=directory)
        sans = ",".join(f"IP:{h}" if h.replace(".", "").isdigit() or ":" in h else f"DNS:{h}" for h in hosts)
        for name, cn, usage, ext in (("server", "etcd", "serverAuth,clientAuth", f"subjectAltName={sans}\n"),
                                     ("client", client_name, "clientAuth", "")):
            (directory / f"{name}.ext").write_text(
                f"{ext}basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
                f"extendedKeyUsage={usage}\n")
            _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={cn}",
                     cwd=directory)
            _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                     "-CAcreateserial", "-out", f"{name}.crt", "-days", str(days), "-extfile", f"{name}.ext",
                     cwd=directory)
            (directory / f"{name}.csr").unlink()
            (directory / f"{name}.ext").unlink()
    finally:
        os.umask(old_umask)
        for leftover in ("ca.key", "ca.srl"):
            (directory / leftover).unlink(missing_ok=True)
    return EtcdCertificates(directory, directory / "ca.crt", directory / "server.crt", directory / "server.key",
                            directory / "client.crt", directory / "client.key")


def write_secret(path: Path, secret: str) -> Path:
    """Write ``secret`` to ``path``, mode 0600 from the start (never world-readable for a moment)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(secret + "\n")
    return path


async def enable_auth(settings: EtcdSettings, directory: Path, *, user: str = "dkv", prefix: str = "/dkv/",
                      timeout: float = READY_TIMEOUT) -> Path:
    """Turn on etcd's user/password authentication; returns the file holding ``user``'s password.

    Creates ``root`` (etcd needs it to enable authentication) and ``user``, whose
    role may read and write the keys under ``prefix`` only (a dKV node needs no
    more: leases and its own keys). Both passwords are random and written mode
    0600 to ``directory/etcd-root-password`` and ``directory/etcd-password``.
    ``settings`` reach the etcd before authentication is on (TLS files if it
    serves TLS). Retries until etcd answers, at most ``timeout`` seconds.
    """
    import secrets

    from etcd3aio import EtcdConnectionError, EtcdTransientError
    from etcd3aio.auth import PermissionType

    from dkv.etcd import make_client, prefix_end

    directory = Path(directory)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    root_password, user_password = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    write_secret(directory / "etcd-root-password", root_password)
    password_file = write_secret(directory / "etcd-password", user_password)
    client = make_client(settings)
    await client.connect()
    try:
        auth = client.auth
        assert auth is not None
        deadline = time.monotonic() + timeout
        while True:  # the first call waits for etcd to answer
            try:
                await auth.user_add("root", root_password, timeout=5)
                break
            except (EtcdConnectionError, EtcdTransientError):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
        await auth.user_grant_role("root", "root", timeout=5)
        await auth.role_add(user, timeout=5)
        await auth.role_grant_permission(user, prefix, prefix_end(prefix), perm_type=PermissionType.READWRITE,
                                         timeout=5)
        await auth.user_add(user, user_password, timeout=5)
        await auth.user_grant_role(user, user, timeout=5)
        await auth.auth_enable(timeout=5)
    finally:
        await client.close()
    return password_file


def etcd_tls_args(certificates: EtcdCertificates | None, client_cert_auth: bool = True) -> list[str]:
    """etcd's flags for TLS on the client port (none without ``certificates``)."""
    if certificates is None:
        return []
    return ["--cert-file", str(certificates.server_cert), "--key-file", str(certificates.server_key),
            "--trusted-ca-file", str(certificates.ca), *(["--client-cert-auth"] if client_cert_auth else [])]


def log_since(log_path: Path, offset: int, tail: int = 1500) -> str:
    """The last ``tail`` characters of what a log got past ``offset`` (one attempt's lines); "" if unreadable."""
    try:
        with open(log_path, "rb") as log:
            log.seek(offset)
            return log.read().decode(errors="replace")[-tail:]
    except OSError:
        return ""


def start_etcd(
    *,
    data_dir: Path | None = None,
    client_port: int | None = None,
    peer_port: int | None = None,
    log_path: Path | None = None,
    host: str = "127.0.0.1",
    ready_timeout: float = READY_TIMEOUT,
    certificates: EtcdCertificates | None = None,
    client_cert_auth: bool = True,
) -> EtcdProcess:
    """Start a single-member etcd and wait until it listens on its client and peer ports.

    Ports not given are picked free, and picked again (up to five times) when
    etcd does not come up on them: another process may take a picked port
    before etcd binds it. etcd counts as up only once its own process holds
    both listening sockets (:func:`cluster.process.listening_on`). Given
    ports (a restart on its old ones) are tried again, :data:`FIXED_PORT_PAUSE`
    apart and up to five times, while etcd finds one in use: another process's
    outgoing connection may hold it for a moment. If it never comes up,
    ``RuntimeError`` carries the end of its log, and the data directory and
    log this call made are removed.

    With ``certificates`` the client port serves TLS only (``https://``), and with
    ``client_cert_auth`` etcd refuses a client without a certificate its CA signed.
    """
    binary = etcd_binary()
    made_dir, made_log = data_dir is None, log_path is None
    data_dir = Path(data_dir or tempfile.mkdtemp(prefix="dkv-etcd-", dir="/dev/shm"))
    log_path = Path(log_path or data_dir.with_suffix(".log"))
    for attempt in range(5):
        offset = log_path.stat().st_size if log_path.exists() else 0
        cport = client_port or free_port(host)
        pport = peer_port or free_port(host)
        scheme = "https" if certificates else "http"
        cmd = [
            binary, "--name", "dkv", "--data-dir", str(data_dir),
            "--listen-client-urls", f"{scheme}://{host}:{cport}",
            "--advertise-client-urls", f"{scheme}://{host}:{cport}",
            "--listen-peer-urls", f"http://{host}:{pport}", "--initial-advertise-peer-urls", f"http://{host}:{pport}",
            "--initial-cluster", f"dkv=http://{host}:{pport}", "--log-level", "warn",
            *etcd_tls_args(certificates, client_cert_auth),
        ]
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        etcd = EtcdProcess(proc, cport, pport, data_dir, log_path, host, certificates, client_cert_auth)
        deadline = time.monotonic() + ready_timeout
        while time.monotonic() < deadline and etcd.alive():
            if listening_on(proc.pid, (cport, pport)):  # its own sockets: a port taken first answers too
                return etcd
            time.sleep(0.05)
        etcd.stop(keep_data=True)
        if client_port is not None:  # fixed ports (a restart): retried only while another process holds one
            if "address already in use" not in log_since(log_path, offset):
                break
            time.sleep(FIXED_PORT_PAUSE)  # (an outgoing connection's port, or another test's pick: it goes)
    tail = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else ""
    if made_dir:
        shutil.rmtree(data_dir, ignore_errors=True)
    if made_log:
        log_path.unlink(missing_ok=True)
    raise RuntimeError(f"etcd did not start after {attempt + 1} attempt(s):\n{tail}")
