"""Fuzzing the handshake, both sides, and a real node under a stream of garbage on raw connections.

* The node's side (:meth:`dkv.server.NodeServer._serve`) runs in-process over
  a control-socket connection (:class:`~dkv.stream_channel.StreamConnection` on
  a socket pair): garbled and mutated hellos, and garbage frames, are refused
  with an error reply and a closed connection, never an internal error, and
  only a hello with the right proof is accepted.
* The client's side (:func:`dkv.client.handshake`) runs over a scripted
  connection: mutated challenges and accepting replies raise dKV's typed
  errors only, and a reply without the node's proof is never accepted.
* One test against a real node process: hypothesis-made sequences of garbage
  and mutated frames on raw connections, over UCX and over the node's
  same-host control socket, some after an authenticated handshake. Then the
  node is alive, counted no internal error, its memory peak stayed within a
  bound of its size before, and a good client still writes and reads a block
  bit-exact.
"""

from __future__ import annotations

import tests.hypothesis_profiles  # noqa: F401  (first: loads the fuzz profile)

import asyncio
import os
import secrets
import socket
from collections import deque
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dkv.client import NodeClient
from dkv.client import handshake as client_handshake
from dkv.errors import DKVError, PeerUnauthenticated
from dkv.keys import BlockKey
from dkv.stream_channel import StreamConnection, connect_local, connect_tcp
from dkv.server import ADMIN_NAMESPACE, NodeConfig, NodeServer
from dkv.transport import connect
from dkv.units import parse_address
from dkv.wire import (
    FLAG_INLINE,
    HEADER,
    MAGIC,
    NONCE_SIZE,
    PROTOCOL_VERSION,
    client_proof,
    encode_body,
    encode_header,
    node_proof,
)
from tests.hypothesis_profiles import examples

TOKEN = b"cluster-token-0123456789"
NS = "test/fuzz"
MEMORY_SLACK = 64 * 2**20  # the node's memory peak may grow this much under the garbage, no more
BOUND = 20.0

wire_scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=40)
                | st.binary(max_size=40))
wire_values = st.recursive(wire_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=10)


def _mutate_message(message: dict[str, Any], draw: st.DrawFn) -> dict[str, Any]:
    """Drop, replace or add one to three fields."""
    out = dict(message)
    for _ in range(draw(st.integers(1, 3))):
        action = draw(st.sampled_from(["drop", "replace", "add"]))
        names = sorted(out)
        if action == "drop" and names:
            out.pop(draw(st.sampled_from(names)))
        elif action == "replace" and names:
            out[draw(st.sampled_from(names))] = draw(wire_values)
        else:
            out[draw(st.text(max_size=8))] = draw(wire_values)
    return out


def _mutate_bytes(data: bytes, draw: st.DrawFn) -> bytes:
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, max(0, len(out) - 1)))
        action = draw(st.sampled_from(["flip", "insert", "truncate"]))
        if action == "flip" and out:
            out[at] ^= draw(st.integers(1, 255))
        elif action == "insert":
            out[at:at] = draw(st.binary(min_size=1, max_size=8))
        else:
            del out[at:]
    return bytes(out)


def _hello(nonce: bytes, *, tenant: str | None = None, namespace: str = NS, secret: bytes = TOKEN) -> dict[str, Any]:
    cnonce = secrets.token_bytes(NONCE_SIZE)
    return {"op": "hello", "v": PROTOCOL_VERSION, "ns": namespace, "client": "fuzz", "tenant": tenant,
            "cnonce": cnonce, "proof": client_proof(secret, nonce, cnonce, namespace, tenant), "host": "elsewhere"}


@st.composite
def claims(draw: st.DrawFn) -> bytes:
    """A body of nested msgpack container headers claiming far more elements than it holds."""
    header = draw(st.sampled_from([b"\xdc\xff\xff", b"\xde\xff\xff", b"\xdd\x00\x01\x00\x00"]))
    return header * draw(st.integers(1, 800))


# ---- the node's side, in-process ----------------------------------------------------------------


@st.composite
def hello_attempts(draw: st.DrawFn) -> tuple[str, Any]:
    """What a client sends after the challenge: a mutated hello (built on the nonce), or raw frame bytes."""
    kind = draw(st.sampled_from(["mutated", "mutated", "wrong_secret", "frame_bytes", "claims"]))
    if kind == "frame_bytes":
        return kind, draw(st.binary(max_size=64))
    if kind == "claims":
        return kind, draw(claims())
    return kind, draw(st.randoms(use_true_random=False))


def _node() -> NodeServer:
    return NodeServer(NodeConfig(pool_size=1 << 20, token=TOKEN, node_id="fuzz-node"))


async def _serve_one(node: NodeServer, attempt: tuple[str, Any], draw: st.DataObject) -> tuple[list[dict], bool]:
    """One connection: challenge, then the attempt; (every reply the node sent, whether it closed the connection)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    client = StreamConnection(ours, "fuzz-client")
    serving = asyncio.create_task(node._serve(StreamConnection(theirs, "fuzz-peer")))
    replies: list[dict] = []
    try:
        challenge = await client.recv_message(5.0)
        kind, payload = attempt
        if kind in ("mutated", "wrong_secret"):
            hello = _hello(challenge["nonce"], secret=TOKEN if kind == "mutated" else b"wrong-secret-0123456789")
            if kind == "mutated":
                hello = _mutate_message(hello, draw.draw)
            await client.send_message(hello, 5.0)
        elif kind == "claims":
            await client.send_raw(encode_header(len(payload)) + payload)
        else:
            await client.send_raw(payload)
        ours.shutdown(socket.SHUT_WR)  # nothing more from us: a frame cut short ends at the stream's end
        try:
            while True:
                replies.append(await client.recv_message(5.0))
        except DKVError:
            pass
        try:
            await asyncio.wait_for(serving, 5.0)
            closed = True
        except TimeoutError:
            closed = False
        return replies, closed
    finally:
        client.abort()
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)


@settings(max_examples=examples(60), suppress_health_check=[HealthCheck.too_slow])
@given(attempt=hello_attempts(), data=st.data())
def test_garbled_hellos_are_refused_with_an_error_reply_never_an_internal_error(attempt: tuple[str, Any],
                                                                                data: st.DataObject) -> None:
    node = _node()
    try:
        replies, closed = asyncio.run(_serve_one(node, attempt, data))
    finally:
        node.store.close()
        node.arena.close()
    assert "internal" not in node.errors_by_code, f"an internal error: {node.errors_by_code}"
    accepted = [r for r in replies if r.get("ok") is True]
    if accepted:  # a mutation that left the hello valid (an extra field, say): the node proves itself
        assert attempt[0] == "mutated" and accepted[0]["node"] == "fuzz-node"
        return
    assert closed, "a refused handshake closes the connection"
    if not replies:  # the stream ended inside a frame: nobody left to answer
        assert attempt[0] == "frame_bytes"
        return
    assert all(r.get("ok") is False and isinstance(r.get("code"), str) for r in replies), replies
    assert sum(node.errors_by_code.values()) >= 1


def test_a_good_hello_is_accepted_with_the_nodes_proof() -> None:
    async def run() -> dict[str, Any]:
        node = _node()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        client = StreamConnection(ours, "good")
        serving = asyncio.create_task(node._serve(StreamConnection(theirs, "peer")))
        try:
            challenge = await client.recv_message(5.0)
            hello = _hello(challenge["nonce"])
            await client.send_message(hello, 5.0)
            reply = await client.recv_message(5.0)
            assert reply["proof"] == node_proof(TOKEN, challenge["nonce"], hello["cnonce"], "fuzz-node")
            return reply
        finally:
            client.abort()
            await asyncio.wait_for(serving, 5.0)
            node.store.close()
            node.arena.close()

    assert asyncio.run(run())["ok"] is True


# ---- the client's side, over a scripted connection ----------------------------------------------


class ScriptedConnection:
    """A connection whose received messages are computed from what the client sent (the node's part, scripted)."""

    def __init__(self, answers: deque[Any]) -> None:
        self.answers = answers
        self.sent: list[dict[str, Any]] = []
        self.peer = "scripted"

    async def send_message(self, message: dict[str, Any], timeout: float = 1.0) -> None:
        self.sent.append(message)

    async def recv_message(self, timeout: float = 1.0, max_frame: int | None = None) -> dict[str, Any]:
        if not self.answers:
            raise DKVError("nothing more to receive")  # (a TransportError in life)
        answer = self.answers.popleft()
        return answer(self.sent) if callable(answer) else answer


@st.composite
def node_scripts(draw: st.DrawFn) -> tuple[deque[Any], dict[str, Any], bool]:
    """The node's challenge and accepting reply, either possibly mutated; whether the reply's proof is the true one."""
    nonce = secrets.token_bytes(NONCE_SIZE)
    challenge: dict[str, Any] = {"t": "challenge", "v": PROTOCOL_VERSION, "nonce": nonce, "node": "n", "local": None}
    mutate_challenge, mutate_reply = draw(st.booleans()), draw(st.booleans())
    if mutate_challenge:
        challenge = _mutate_message(challenge, draw)
        challenge.pop("local", None)  # (a tokenless client reads the file it names: not this test's subject)
    extra = _mutate_message({}, draw) if mutate_reply else {}
    refusal = draw(st.none() | st.fixed_dictionaries({"ok": st.just(False), "code": wire_values, "msg": wire_values}))

    def reply(sent: list[dict[str, Any]]) -> dict[str, Any]:
        if refusal is not None:
            return refusal
        proof = node_proof(TOKEN, nonce, sent[-1]["cnonce"], "n")  # over the nonce the node really sent
        return {"ok": True, "node": "n", "epoch": "e", "host": "h", "limits": {}, "shm": None, "proof": proof,
                **extra}

    proof_intact = refusal is None and not {"proof", "node", "ok"} & set(extra)
    return deque([challenge, reply]), challenge, proof_intact and challenge.get("nonce") == nonce


@settings(max_examples=examples(100))
@given(script=node_scripts())
def test_the_client_refuses_a_garbled_handshake_with_typed_errors_and_trusts_only_the_nodes_proof(
        script: tuple[deque[Any], dict[str, Any], bool]) -> None:
    answers, challenge, intact = script
    conn = ScriptedConnection(answers)
    try:
        reply = asyncio.run(client_handshake(conn, NS, secret=TOKEN, host="elsewhere"))  # type: ignore[arg-type]
    except PeerUnauthenticated:
        assert not intact, "the node's true proof was refused"
        return
    except DKVError:
        return
    # accepted: only over a proof of the token, the nonce the client signed, its own cnonce and the node's id
    hello = conn.sent[0]
    assert hello["proof"] == client_proof(TOKEN, challenge["nonce"], hello["cnonce"], NS, None)
    assert reply["ok"] is True
    assert reply["proof"] == node_proof(TOKEN, challenge["nonce"], hello["cnonce"], reply["node"])


# ---- a real node under garbage ------------------------------------------------------------------


@st.composite
def raw_frames(draw: st.DrawFn) -> bytes:
    """One UCX message (or control-socket write) of garbage: random, a mutated valid request, claims, a big header."""
    kind = draw(st.sampled_from(["random", "mutated", "mutated", "claims", "announce"]))
    if kind == "random":
        return draw(st.binary(min_size=1, max_size=128))
    if kind == "claims":
        body = draw(claims())
        return encode_header(len(body), FLAG_INLINE) + body
    if kind == "announce":  # a header announcing a body that never comes
        return HEADER.pack(MAGIC, PROTOCOL_VERSION, 0, draw(st.integers(0, 2**32 - 1)), 0)
    op = draw(st.sampled_from(["lookup", "probe", "touch", "read", "commit", "abort", "release", "end",
                               "done", "stats", "clear", "write", "hello"]))
    base: dict[str, Any] = {"op": op, "hashes": [os.urandom(8)], "leaves": ["L"], "shards": 1, "lease": True,
                            "group": 0, "keys": [["L", 0, os.urandom(8)]], "end": True, "shm": False,
                            "write": 1, "read": 1, "sizes": [0]}
    message = _mutate_message(base, draw) if draw(st.booleans()) else base
    body = encode_body(message)
    frame = encode_header(len(body), FLAG_INLINE) + body
    return _mutate_bytes(frame, draw) if draw(st.booleans()) else frame


connection_scripts = st.lists(st.tuples(st.sampled_from(["ucx", "local", "tcp"]), st.booleans(),
                                        st.lists(raw_frames(), min_size=1, max_size=4)), min_size=1, max_size=4)


def _memory(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} for pid {pid}")


async def _round_trip(address: str) -> None:
    client = NodeClient(address, NS, token=TOKEN, timeout=10.0)
    try:
        key = BlockKey("L", 0, os.urandom(32))
        data = os.urandom(256 * 1024)
        await client.write([key], [data])
        found = await client.lookup([key.hash], ["L"])
        assert found.masks == {"L": [True]}
        dest = bytearray(len(data))
        await client.read(found.lease_id, [key], [dest])
        assert dest == data, "a good client's block came back with other bytes"
    finally:
        await client.close()


async def _stats(address: str) -> dict[str, Any]:
    admin = NodeClient(address, ADMIN_NAMESPACE, token=TOKEN, pool_size=1)
    try:
        return await admin.stats()
    finally:
        await admin.close()


async def _control_sockets(address: str) -> tuple[str, int]:
    """The name of the node's same-host control socket and its TCP control port, from an authenticated UCX handshake."""
    conn = await connect(*parse_address(address))
    try:
        reply = await client_handshake(conn, NS, secret=TOKEN)
        return reply["shm"]["control"], reply["peer_control"]
    finally:
        conn.abort()


async def _send_garbage(address: str, control: tuple[str, int], script: list[tuple[str, bool, list[bytes]]]) -> None:
    host = parse_address(address)[0]
    for path, authenticate, frames in script:
        try:
            conn: Any = await (connect(*parse_address(address)) if path == "ucx"
                               else connect_local(control[0]) if path == "local" else connect_tcp(host, control[1]))
        except DKVError:
            continue  # a cap reached, say: the node refuses, which is its right
        try:
            if authenticate:
                await client_handshake(conn, NS, secret=TOKEN, host="elsewhere")
            for frame in frames:
                await conn.send_raw(frame, 2.0)
            with_reply = asyncio.ensure_future(conn.recv_message(0.5))
            await asyncio.gather(with_reply, return_exceptions=True)
        except DKVError:
            pass  # the node refused and closed: expected
        finally:
            conn.abort()


@pytest.fixture
def fuzzed_node() -> dict[str, Any]:
    """The real-node test's state, kept across its examples (one node for all of them)."""
    return {}


@settings(max_examples=examples(8), suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                           HealthCheck.too_slow])
@given(script=connection_scripts)
@example(script=[(path, auth, [encode_header(4095, FLAG_INLINE) + b"\xdc\xff\xff" * 1365] * 3)  # nested claims
                 for path, auth in (("ucx", False), ("ucx", True), ("local", True), ("tcp", False),
                                   ("tcp", True))])
def test_a_node_fed_garbage_on_raw_connections_stays_up_bounded_and_serves_a_good_client_bit_exact(
        node_factory, ucx_loop, fuzzed_node: dict[str, Any], script: list[tuple[str, bool, list[bytes]]]) -> None:
    if "node" not in fuzzed_node:
        node = node_factory(token=TOKEN)
        ucx_loop.run(_round_trip(node.address), 60)  # served once: its baseline
        fuzzed_node.update(node=node, control=ucx_loop.run(_control_sockets(node.address), 30),
                           baseline=max(_memory(node.pid, "VmRSS"), _memory(node.pid, "VmHWM")))
    node, control, baseline = fuzzed_node["node"], fuzzed_node["control"], fuzzed_node["baseline"]
    ucx_loop.run(_send_garbage(node.address, control, script), 60)
    assert node.alive(), f"the node died:\n{node.log_tail()}"
    stats = ucx_loop.run(_stats(node.address), 30)
    assert "internal" not in stats["errors"], f"internal errors: {stats['errors']}\n{node.log_tail()}"
    peak = _memory(node.pid, "VmHWM")
    assert peak - baseline < MEMORY_SLACK, (
        f"the node's memory peaked at {peak >> 20} MiB, {(peak - baseline) >> 20} MiB over its "
        f"{baseline >> 20} MiB before the garbage")
    ucx_loop.run(_round_trip(node.address), 60)
