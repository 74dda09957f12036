"""One error tree for dKV.

::

    DKVError
     ├── ConfigError              bad configuration or command-line input
     ├── ProtocolError            a peer sent something the wire protocol forbids
     │    └── FrameTooLarge       a frame header announced more than the bound
     ├── RemoteError              the node answered an op with an error reply
     │    ├── AuthError           handshake refused: token proof or namespace
     │    ├── LeaseExpired        a read named a lease the node no longer holds
     │    ├── WriteRejected       a commit or write the node refused
     │    ├── NodeBusy            the node is at a bound it will not make room under (code "busy")
     │    └── RequestTooCostly    a lookup/probe/touch over the node's max_cost (code "too_costly")
     ├── PeerUnauthenticated      a peer accepted us but could not prove the credential
     ├── ReadNotIntact            a same-host copy outlived its read's pins: discard it
     ├── ChecksumMismatch         blocks whose bytes do not match their checksum: discard them
     ├── TransportError           the connection failed or closed
     │    └── OpTimeout           an await exceeded its bound
     ├── ClusterError             etcd could not be reached or refused us
     │    └── NodeIdTaken         another live node holds this node id
     └── PoolFull                 the arena has no room, even after eviction

``ValueError`` (not a DKVError) is raised for bad arguments at API boundaries,
such as a hash of the wrong length: that is a programming error of the caller.
Foreign errors (UCX, OS) are translated at the boundary with ``raise ... from``.
"""

from __future__ import annotations


class DKVError(Exception):
    """Root of every error dKV raises on purpose."""


class ConfigError(DKVError):
    """Configuration or command-line input that cannot be used."""


class ProtocolError(DKVError):
    """A peer sent a frame or message that the wire protocol forbids."""


class FrameTooLarge(ProtocolError):
    """A frame header announced a body larger than the negotiated bound."""


class RemoteError(DKVError):
    """The node answered with an error reply.

    ``code`` is the machine-readable reason carried on the wire.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class AuthError(RemoteError):
    """Handshake refused (bad token proof, bad or foreign namespace, version)."""


class LeaseExpired(RemoteError):
    """A read named a lease the node does not hold any more."""


class WriteRejected(RemoteError):
    """The node refused a write or a commit (expired reservation, bad sizes)."""


class NodeBusy(RemoteError):
    """The node is at a bound it does not make room under by ending anyone's work (code ``busy``).

    For instance every lease the node may hold is held (``--max-leases-total``):
    a leased lookup is refused rather than ending another client's lease.
    Nothing was changed; trying again later may succeed.

    Also a connection the node will not take: every connection it may hold
    (``--max-connections``), or every one this credential may hold, is open
    and none has been idle long enough to be closed for it; or too many
    connections are still authenticating (``--max-unauthenticated``).
    """


class RequestTooCostly(RemoteError):
    """A lookup, probe or touch whose hashes x leaves x shards exceeds the node's ``max_cost`` (code ``too_costly``).

    Refused before any work; the connection stays usable. The client library
    splits unleased requests to fit (a leased lookup cannot be split: it
    raises ``ValueError`` before sending).
    """


class PeerUnauthenticated(DKVError):
    """The peer completed the handshake but could not prove the credential back: not a node of ours."""


class ReadNotIntact(DKVError):
    """A same-host read's pins ended before its copy finished (read TTL): the bytes may be torn."""


class ChecksumMismatch(DKVError):
    """Blocks whose bytes did not match their end-to-end checksum (:mod:`dkv.checksum`).

    Raised by a read after the bytes arrived (the destinations hold garbage
    and must not be used), and by a write whose blocks the node refused to
    commit because the bytes it received did not match what the client
    declared (those blocks were not stored). ``count`` is how many blocks
    failed; ``first_key`` the first of them, when known.
    """

    def __init__(self, message: str, *, count: int = 0, first_key: tuple[str, int, bytes] | None = None) -> None:
        super().__init__(message)
        self.count = count
        self.first_key = first_key


class TransportError(DKVError):
    """The connection to a peer failed, closed, or could not be made."""


class OpTimeout(TransportError):
    """A network await ran past its bound."""


class ClusterError(DKVError):
    """etcd could not be reached, or refused what the node asked."""


class NodeIdTaken(ClusterError):
    """Another live node already holds this node id in the cluster."""


class PoolFull(DKVError):
    """No slot could be found for a block, even after evicting what may be evicted."""


_REMOTE_CODES: dict[str, type[RemoteError]] = {
    "auth": AuthError,
    "namespace": AuthError,
    "forbidden": AuthError,
    "version": AuthError,
    "lease_expired": LeaseExpired,
    "write_rejected": WriteRejected,
    "busy": NodeBusy,
    "too_costly": RequestTooCostly,
}


def remote_error(code: str, message: str) -> RemoteError:
    """Build the most specific :class:`RemoteError` for a wire error ``code``."""
    return _REMOTE_CODES.get(code, RemoteError)(code, message)
