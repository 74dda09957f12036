"""Who may connect to a node, to which namespaces, with which rights and within which quotas.

A node knows two kinds of credential:

* the **cluster credential** (``--token-file``): the operator's. It may claim
  any namespace the node serves, read and write, within the node's default
  quotas. Routers, the CLI and single-tenant deployments use it. A node
  started without a token makes a random one of its own and keeps it in a
  file only its own OS user can read (:class:`LocalCredential`): a client on
  the same host that can read that file may connect, nobody else.
* **tenant credentials** (``--tenants FILE``): one secret per tenant, bound to
  the namespaces the tenant may claim (``fnmatch`` patterns), an access right
  (``read`` or ``write``) and its own quotas. Holding one tenant's secret
  grants nothing of another's: a hello for a namespace outside the tenant's
  patterns is refused, and a same-host client is handed only its own
  namespace's memory (read-only for ``read``).

The tenants file is TOML::

    [tenants.acme]
    secret_file = "acme.secret"      # or: secret = "..." (at least 16 characters)
    namespaces = ["acme.*"]
    access = "write"                 # or "read"
    max_stored_bytes = "8GiB"        # quotas: sizes as in --pool; omitted = the node's default
    max_reserved_bytes = "1GiB"
    max_blocks = 100000
    max_leases = 256
    max_connections = 64
"""

from __future__ import annotations

import contextlib
import fcntl
import fnmatch
import os
import re
import secrets
import stat
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dkv.errors import ConfigError

CLUSTER = ""  # the cluster (operator) credential's name
READ, WRITE = "read", "write"
MIN_SECRET_LENGTH = 16
_TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_QUOTA_FIELDS = ("max_stored_bytes", "max_reserved_bytes", "max_blocks", "max_leases", "max_connections")
_SIZE_FIELDS = ("max_stored_bytes", "max_reserved_bytes")


@dataclass(frozen=True)
class Quotas:
    """A credential's bounds on one node; ``None`` means the node's default for every credential."""

    max_stored_bytes: int | None = None
    max_reserved_bytes: int | None = None
    max_blocks: int | None = None
    max_leases: int | None = None
    max_connections: int | None = None


@dataclass(frozen=True)
class Credential:
    """One credential: a name, its secret, the namespaces it may claim, its access right and quotas."""

    name: str
    secret: bytes = field(repr=False)
    namespaces: tuple[str, ...] = ("*",)
    access: str = WRITE
    quotas: Quotas = Quotas()

    def allows(self, namespace: str) -> bool:
        """True when this credential may claim ``namespace``."""
        return any(fnmatch.fnmatchcase(namespace, pattern) for pattern in self.namespaces)

    @property
    def can_write(self) -> bool:
        return self.access == WRITE

    @property
    def label(self) -> str:
        """How stats and errors name it."""
        return self.name or "cluster"


def check_secret(secret: bytes, where: str) -> bytes:
    secret = secret.strip()
    if len(secret) < MIN_SECRET_LENGTH:
        raise ConfigError(f"secret in {where} is too short: use at least {MIN_SECRET_LENGTH} characters")
    return secret


def load_tenants(path: Path) -> dict[str, Credential]:
    """Read a tenants file (TOML, see the module docstring); :class:`ConfigError` on anything wrong."""
    from dkv.units import parse_size  # sizes read as --pool reads them

    try:
        document = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read tenants file {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"tenants file {path} is not valid TOML: {exc}") from exc
    table = document.get("tenants")
    if not isinstance(table, dict) or not table:
        raise ConfigError(f"tenants file {path} has no [tenants.NAME] table")
    tenants = {}
    for name, spec in table.items():
        where = f"{path} [tenants.{name}]"
        if not _TENANT_NAME.match(name):
            raise ConfigError(f"{where}: tenant names are letters, digits, '.', '_', '-' (at most 64)")
        if not isinstance(spec, dict):
            raise ConfigError(f"{where}: must be a table")
        unknown = set(spec) - {"secret", "secret_file", "namespaces", "access", *_QUOTA_FIELDS}
        if unknown:
            raise ConfigError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
        if ("secret" in spec) == ("secret_file" in spec):
            raise ConfigError(f"{where}: give exactly one of secret, secret_file")
        if "secret" in spec:
            secret = check_secret(str(spec["secret"]).encode(), where)
        else:
            secret_path = (path.parent / str(spec["secret_file"]))
            try:
                secret = check_secret(secret_path.read_bytes(), str(secret_path))
            except OSError as exc:
                raise ConfigError(f"{where}: cannot read {secret_path}: {exc.strerror}") from exc
        namespaces = spec.get("namespaces")
        if not isinstance(namespaces, list) or not namespaces or not all(isinstance(n, str) and n for n in namespaces):
            raise ConfigError(f"{where}: namespaces must be a non-empty list of patterns")
        access = spec.get("access", WRITE)
        if access not in (READ, WRITE):
            raise ConfigError(f"{where}: access must be 'read' or 'write', not {access!r}")
        quotas: dict[str, Any] = {}
        for name_q in _QUOTA_FIELDS:
            if name_q in spec:
                value = spec[name_q]
                try:
                    value = parse_size(str(value)) if name_q in _SIZE_FIELDS else int(value)
                except (ValueError, ConfigError) as exc:
                    raise ConfigError(f"{where}: {name_q}: {exc}") from exc
                if value < 0 or isinstance(spec[name_q], bool):
                    raise ConfigError(f"{where}: {name_q} must be a non-negative number")
                quotas[name_q] = value
        tenants[name] = Credential(name, secret, tuple(namespaces), access, Quotas(**quotas))
    return tenants


class Credentials:
    """A node's credential table: the cluster credential plus tenants, looked up by the name a hello gives."""

    def __init__(self, cluster: Credential, tenants: Mapping[str, Credential] | None = None) -> None:
        self.cluster = cluster
        self.tenants = dict(tenants or {})

    def get(self, tenant: str | None) -> Credential | None:
        """The credential a hello names (``None``/empty: the cluster's); ``None`` when unknown."""
        if not tenant:
            return self.cluster
        return self.tenants.get(tenant)


class LocalCredential:
    """A tokenless node's own secret, in a file only this OS user can read (mode 0600).

    UCX listeners bind every interface whatever address was asked for, so a
    node without a cluster token cannot rely on "loopback only" to keep the
    network out. It makes a random secret instead and announces the file's
    path in its challenge: a client on the same host, running as a user that
    can read the file, proves that secret; a client anywhere else cannot.
    The owner removes the file with :meth:`close`.

    The owner also holds an exclusive ``flock`` on the file for as long as it
    lives; the kernel drops it when the process dies, however it dies. A file
    whose lock can be taken therefore belongs to a dead node: each new one
    removes such orphans of its OS user (:func:`remove_orphaned_credentials`)
    before it writes its own. The file appears under its name already locked
    (written as a draft, locked, then renamed), so no start can take a live
    node's file for an orphan. A PID in the name would not prove as much:
    PIDs are reused, and a node in another PID namespace sharing /dev/shm has
    a PID this one cannot see.
    """

    DIRECTORY = "/dev/shm"

    def __init__(self, label: str) -> None:
        remove_orphaned_credentials(self.DIRECTORY)
        self.secret = secrets.token_hex(32).encode()
        for attempt in range(3):
            self.name = f"dkv-{label}-{os.getpid()}-{secrets.token_hex(4)}.credential"
            self.path = os.path.join(self.DIRECTORY, self.name)
            draft = os.path.join(self.DIRECTORY, f"{self.name}.new")  # locked before it takes its name
            self._fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.write(self._fd, self.secret)
                os.rename(draft, self.path)
                return
            except (FileNotFoundError, BlockingIOError):  # another start took the draft for an orphan
                os.close(self._fd)  # before it was locked: that start removes it; try another name
                if attempt == 2:
                    raise
            except BaseException:
                os.close(self._fd)
                with contextlib.suppress(OSError):
                    os.unlink(draft)
                raise

    def close(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        if self._fd >= 0:
            os.close(self._fd)  # (the lock goes with it)
            self._fd = -1


_CREDENTIAL_NAME = re.compile(r"^dkv-[A-Za-z0-9_-]+\.credential$")
_DRAFT_NAME = re.compile(r"^dkv-[A-Za-z0-9_-]+\.credential\.new$")


def remove_orphaned_credentials(directory: str) -> list[str]:
    """Remove the credential files of this OS user in ``directory`` that no live node holds; their names.

    A file is an orphan when its exclusive lock can be taken (see
    :class:`LocalCredential`); it is removed while that lock is held.
    """
    removed = []
    try:
        names = [n for n in os.listdir(directory) if _CREDENTIAL_NAME.match(n) or _DRAFT_NAME.match(n)]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:  # another user's, or gone meanwhile
            continue
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # a live node holds it
                continue
            os.unlink(path)
            removed.append(name)
        except OSError:
            continue
        finally:
            os.close(fd)
    return removed


def read_local_credential(path: str) -> bytes | None:
    """A tokenless node's secret from the file its challenge named; ``None`` when not readable here."""
    name = os.path.basename(path)
    if os.path.dirname(path) != LocalCredential.DIRECTORY or not _CREDENTIAL_NAME.match(name):
        return None
    try:
        secret = Path(path).read_bytes().strip()
    except OSError:
        return None
    return secret if len(secret) >= MIN_SECRET_LENGTH else None
