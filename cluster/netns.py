"""Network namespaces for a local cluster whose nodes talk across a real network stack (root only).

Every member (etcd, each node, a client) gets a namespace of its own with one
veth interface on a private /24; the other ends of the veths are joined by a
bridge that lives in a namespace of its own too. Nothing is added to the
machine's own namespace, and every process that talks to the private
addresses runs inside one of the namespaces (``ip netns exec``): traffic
never leaves through the machine's real interfaces.

UCX's shared-memory transports hang between namespaces on these machines, so
processes in them run with ``UCX_TLS=tcp`` (see :data:`NETNS_ENV`).
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass, field

NETNS_ENV = {"UCX_TLS": "tcp"}  # shared-memory transports hang between namespaces here


class NetnsUnavailable(RuntimeError):
    """Not root, or no ``ip`` with netns support."""


def netns_available() -> str | None:
    """``None`` when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the `ip` command (Debian package iproute2) is missing"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns` does not work here: {probe.stderr.strip()}"
    return None


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise NetnsUnavailable(f"ip {' '.join(args)}: {result.stderr.strip()}")


@dataclass
class NetnsLayout:
    """Namespaces ``<tag>-<member>`` on 10.<a>.<b>.0/24, bridged in ``<tag>-br``."""

    tag: str
    members: list[str]
    subnet: tuple[int, int]
    created: list[str] = field(default_factory=list)

    @classmethod
    def new(cls, members: list[str]) -> NetnsLayout:
        raw = secrets.token_bytes(2)
        return cls(f"dkv{secrets.token_hex(3)}", list(members), (200 + raw[0] % 50, raw[1]))

    def namespace(self, member: str) -> str:
        return f"{self.tag}-{member}"

    @property
    def bridge_namespace(self) -> str:
        return f"{self.tag}-br"

    def address(self, member: str) -> str:
        return f"10.{self.subnet[0]}.{self.subnet[1]}.{self.members.index(member) + 1}"

    def exec_prefix(self, member: str) -> list[str]:
        return ["ip", "netns", "exec", self.namespace(member)]

    def create(self) -> None:
        """Make the bridge namespace and one namespace per member; undone by :meth:`destroy` on failure."""
        reason = netns_available()
        if reason:
            raise NetnsUnavailable(reason)
        try:
            br = self.bridge_namespace
            _ip("netns", "add", br)
            self.created.append(br)
            _ip("-n", br, "link", "set", "lo", "up")
            _ip("-n", br, "link", "add", "br0", "type", "bridge")
            _ip("-n", br, "link", "set", "br0", "up")
            for i, member in enumerate(self.members):
                ns = self.namespace(member)
                _ip("netns", "add", ns)
                self.created.append(ns)
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"p{i}", "netns", br)
                _ip("-n", br, "link", "set", f"p{i}", "master", "br0")
                _ip("-n", br, "link", "set", f"p{i}", "up")
                _ip("-n", ns, "addr", "add", f"{self.address(member)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
        except BaseException:
            self.destroy()
            raise

    def destroy(self) -> None:
        """Delete every namespace made (their veths and the bridge go with them). Idempotent."""
        for ns in reversed(self.created or [self.bridge_namespace, *map(self.namespace, self.members)]):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self.created = []
