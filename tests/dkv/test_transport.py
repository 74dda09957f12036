"""The UCX transport: a peer that answers late never writes into this process's memory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_node_that_stops_answering_and_then_answers_late_writes_nothing_into_the_client(node) -> None:
    # in a process of its own, so that a late write into freed memory shows as that process's crash
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("late_answer.py")), str(node.pid),
                           node.address], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONFAULTHANDLER": "1"})
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), (
        f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-3000:]}")
    assert node.alive()


def test_a_client_that_stalls_its_handshake_and_then_completes_it_leaves_the_node_serving(node) -> None:
    host, port = node.address.rsplit(":", 1)
    stall = 7.0  # longer than the handshake timeout a listener could have had (CONNECT_TIMEOUT)
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("stalled_handshake.py")), host, port,
                           str(stall)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stdout + done.stderr[-3000:]
    assert node.alive(), "the node must survive a client that answered its handshake late"
    late = subprocess.run([sys.executable, str(Path(__file__).with_name("late_answer.py")), str(node.pid),
                           node.address], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert late.returncode == 0 and late.stdout.strip().endswith("OK"), late.stdout + late.stderr[-3000:]
    assert node.alive()


# ---- framing and payload batching, over a loopback pair in this process --------------------------

import asyncio  # noqa: E402
import contextlib  # noqa: E402
from collections.abc import AsyncIterator, Awaitable, Callable  # noqa: E402
from contextlib import asynccontextmanager  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from dkv import transport  # noqa: E402
from dkv.errors import DKVError, FrameTooLarge, ProtocolError  # noqa: E402
from dkv.wire import (FLAG_INLINE, FLAG_TRAILING, HEADER, MAGIC, MAX_FRAME, PROTOCOL_VERSION, encode_body,  # noqa: E402
                      encode_header)
from tests.conftest import on_ucx  # noqa: E402

KIB = 1024


@asynccontextmanager
async def _pair() -> AsyncIterator[tuple[transport.Connection, transport.Connection]]:
    """A connected (client, server) pair through a listener of this process (run on the UCX loop)."""
    accepted: asyncio.Queue[transport.Connection] = asyncio.Queue()

    async def handler(conn: transport.Connection) -> None:
        await accepted.put(conn)

    listener = transport.Listener(handler)
    client = server = None
    try:
        client = await transport.connect("127.0.0.1", listener.port)
        server = await asyncio.wait_for(accepted.get(), 10)
        yield client, server
    finally:
        for conn in (client, server):
            if conn is not None:
                conn.abort()
        listener.close()


def _run(test: Callable[[transport.Connection, transport.Connection], Awaitable[Any]]) -> Any:
    async def body() -> Any:
        async with _pair() as (client, server):
            return await test(client, server)

    return on_ucx(body())


def test_payload_plan_groups_small_buffers_and_sends_large_or_tiny_ones_alone() -> None:
    group, direct = transport.GROUP_BYTES, transport.DIRECT_MIN
    assert transport.payload_plan([]) == []
    assert transport.payload_plan([64 * KIB] * 3) == [(0, 3)]
    per_group = group // (64 * KIB)
    assert transport.payload_plan([64 * KIB] * (per_group + 1)) == [(0, per_group), (per_group, per_group + 1)]
    assert transport.payload_plan([100, direct, 100, 100, 3, 100]) == [(0, 1), (1, 2), (2, 4), (4, 5), (5, 6)]
    sizes = [1 + (i * 7919) % (300 * KIB) for i in range(200)]
    plan = transport.payload_plan(sizes)
    assert plan == transport.payload_plan(list(sizes)), "deterministic from the sizes"
    assert [i for a, b in plan for i in range(a, b)] == list(range(len(sizes))), "every buffer once, in order"
    assert all(b - a == 1 or sum(sizes[a:b]) <= group for a, b in plan)


def test_a_plan_with_offsets_joins_back_to_back_large_buffers_under_the_group_bound_only() -> None:
    group, direct = transport.GROUP_BYTES, transport.DIRECT_MIN
    quarter = group // 4
    assert quarter >= direct
    back_to_back = [i * quarter for i in range(9)]
    assert transport.payload_plan([quarter] * 9, back_to_back) == [(0, 4), (4, 8), (8, 9)]
    assert transport.payload_plan([quarter] * 9) == [(i, i + 1) for i in range(9)], "sizes alone: each alone"
    gaps = [i * 2 * quarter for i in range(4)]
    assert transport.payload_plan([quarter] * 4, gaps) == [(0, 1), (1, 2), (2, 3), (3, 4)], "not back to back"
    # a group of 1 MiB blocks stays one block a message; small ones group as from the sizes alone
    assert transport.payload_plan([group, group], [0, group]) == [(0, 1), (1, 2)]
    sizes = [64 * KIB] * 3 + [quarter] * 2 + [3] + [quarter] * 2
    offsets = [0, 64 * KIB, 128 * KIB, 192 * KIB, 192 * KIB + quarter, 192 * KIB + 2 * quarter,
               192 * KIB + 2 * quarter + 3, 192 * KIB + 3 * quarter + 3]
    assert transport.payload_plan(sizes, offsets) == [(0, 3), (3, 5), (5, 6), (6, 8)]
    assert transport.payload_plan(sizes, offsets)[0] == transport.payload_plan(sizes)[0]


def test_the_native_buffer_run_is_built() -> None:
    assert transport._buffer_run is not None, (
        "dkv._buffer_run was not built: install a C compiler, then `pip install -e .` again (scripts/run.sh does both)")


@pytest.mark.parametrize("twin", ["native", "python"])
def test_a_span_covers_buffers_only_where_they_lie_back_to_back_and_writable_when_asked(twin: str) -> None:
    span = transport._span if twin == "native" else transport._span_python
    whole = bytearray(os.urandom(4096))
    view = memoryview(whole)
    cuts = [view[0:100], view[100:1000], view[1000:4096]]
    sizes = [c.nbytes for c in cuts]
    for writable in (False, True):
        got = span(cuts, sizes, writable)
        assert got is not None and bytes(memoryview(got).cast("B")) == bytes(whole)
    assert span([view[0:100], view[200:300]], [100, 100]) is None  # a gap
    assert span([view[100:200], view[0:100]], [100, 100]) is None  # back to back the other way round
    assert span([view[:1]], [1]) is not None
    frozen = memoryview(bytes(whole))
    assert span([frozen[:10], frozen[10:20]], [10, 10], True) is None  # read-only: no writable span
    assert span([frozen[:10], frozen[10:20]], [10, 10], False) is not None
    strided = memoryview(np.arange(64, dtype=np.uint8))[::2]
    assert span([strided, strided], [32, 32]) is None  # not C-contiguous


def test_an_announced_plan_is_taken_only_when_it_covers_every_buffer_within_the_group_bound() -> None:
    quarter = transport.GROUP_BYTES // 4
    sizes = [quarter] * 9
    plan = transport.payload_plan(sizes, [i * quarter for i in range(9)])
    assert transport.plan_groups(plan) == [4, 4, 1]
    assert transport.plan_from_groups([4, 4, 1], sizes) == plan
    assert transport.plan_from_groups((1,) * 9, sizes) == [(i, i + 1) for i in range(9)]
    assert transport.plan_from_groups([], []) == []
    for bad in ([5, 4], [4, 4], [4, 4, 2], [0, 4, 4, 1], [-1, 10], [True] * 9, [4.0, 4, 1], "441", None,
                {"a": 1}, [9 * [1]], [1] * 10):
        with pytest.raises(ProtocolError):
            transport.plan_from_groups(bad, sizes)
    with pytest.raises(ProtocolError, match="group bound"):  # a tiny buffer has no room for its canary
        transport.plan_from_groups([2], [64 * KIB, 3])


@pytest.mark.parametrize("dst_adjacent", [False, True], ids=["scattered", "spanned-dest"])
async def test_payloads_cut_as_the_sender_announced_arrive_bit_exact_and_reported_in_order(dst_adjacent: bool) -> None:
    async def check(client: transport.Connection, server: transport.Connection) -> None:
        quarter = transport.GROUP_BYTES // 4
        sizes = [quarter] * 6 + [64 * KIB] * 3 + [quarter] * 3 + [5] + [3 * quarter]
        whole = bytearray(os.urandom(sum(sizes) + quarter))
        view, sources, offsets, at = memoryview(whole), [], [], 0
        for i, n in enumerate(sizes):
            at += quarter if i == 3 else 0  # a gap in the sender's memory: the run of quarters is cut there
            sources.append(view[at:at + n])
            offsets.append(at)
            at += n
        plan = transport.payload_plan(sizes, offsets)
        assert plan[:3] == [(0, 3), (3, 6), (6, 9)] and len(plan) < len(sizes) - 3
        dests = _dests(sizes, dst_adjacent)
        runs: list[tuple[int, int]] = []
        await asyncio.gather(server.send_payloads(sources, 10, transport.plan_groups(plan)),
                             client.recv_payloads(dests, 10, lambda a, b: runs.append((a, b)),
                                                  transport.plan_groups(plan)))
        assert [bytes(d) for d in dests] == [bytes(s) for s in sources]
        assert runs == plan, "each announced message is reported once it is whole, in order"
        await client.send_message({"after": True})  # the stream is still in step
        assert await server.recv_message() == {"after": True}

    await _run(check)


async def test_a_malformed_announced_plan_aborts_before_any_receive_is_posted_or_byte_sent() -> None:
    async def receiving(client: transport.Connection, server: transport.Connection) -> None:
        dests = [bytearray(64 * KIB) for _ in range(4)]
        with pytest.raises(ProtocolError, match="payload groups"):
            await client.recv_payloads(dests, 10, groups=[2, 3])
        assert client.closed

    async def sending(client: transport.Connection, server: transport.Connection) -> None:
        dests = [bytearray(64 * KIB) for _ in range(4)]
        receive = asyncio.ensure_future(client.recv_payloads(dests, 3))
        with pytest.raises(ProtocolError, match="payload groups"):
            await server.send_payloads([os.urandom(64 * KIB) for _ in dests], 10, groups=[1, 1, 1, 1, 1])
        assert server.closed
        with pytest.raises(DKVError):  # the peer went away, or the wait ran out: nothing arrived either way
            await receive
        assert all(not any(d) for d in dests), "no byte was sent"

    await _run(receiving)
    await _run(sending)


@pytest.mark.parametrize("body_size", [0, 100, transport.INLINE_MAX - 64, transport.INLINE_MAX + 1, 3 * 2**20])
async def test_messages_inline_or_split_arrive_whole(body_size: int) -> None:
    async def check(client: transport.Connection, server: transport.Connection) -> None:
        message = {"op": "x", "pad": os.urandom(body_size)}
        _, got = await asyncio.gather(client.send_message(message), server.recv_message())  # big: rendezvous
        assert got == message
        await server.send_message({"ok": True})
        assert await client.recv_message() == {"ok": True}

    await _run(check)


async def test_a_header_and_a_body_sent_as_two_raw_messages_read_as_one_frame() -> None:
    async def check(client: transport.Connection, server: transport.Connection) -> None:
        body = encode_body({"op": "raw"})
        await client.send_raw(encode_header(len(body)))
        await client.send_raw(body)
        assert await server.recv_message() == {"op": "raw"}
        await client.send_raw(encode_header(len(body), FLAG_INLINE) + body)
        assert await server.recv_message() == {"op": "raw"}

    await _run(check)


async def test_bytes_after_an_inline_body_come_in_its_message_only_to_a_receiver_that_made_room() -> None:
    async def check(client: transport.Connection, server: transport.Connection) -> None:
        blocks = [os.urandom(64 * KIB), b"", os.urandom(5), memoryview(bytearray(os.urandom(3000)))[1000:]]
        assert await server.send_message_with({"ok": True, "n": 1}, blocks) is True
        got, trailing = await client.recv_message_with(256 * KIB)
        assert got == {"ok": True, "n": 1} and bytes(trailing) == b"".join(bytes(b) for b in blocks)

        # no trailing bytes: the message alone, None
        await server.send_message({"ok": True, "n": 2})
        assert await client.recv_message_with(256 * KIB) == ({"ok": True, "n": 2}, None)
        # a body too large to be inline: the message goes alone, the caller sends its bytes its other way
        big = {"ok": True, "pad": os.urandom(transport.INLINE_MAX)}
        sent, (got, trailing) = await asyncio.gather(server.send_message_with(big, [b"x" * 10]),
                                                     client.recv_message_with(256 * KIB))
        assert sent is False and got == big and trailing is None

    async def refused(room: int, size: int) -> None:
        async def check_refused(client: transport.Connection, server: transport.Connection) -> None:
            body = encode_body({"ok": True})
            # a header that claims more trailing bytes than the receiver made room for: refused on its claim
            await server.send_raw(encode_header(len(body), FLAG_INLINE | FLAG_TRAILING, size) + body + b"z" * 16)
            with pytest.raises(ProtocolError, match="trailing"):
                if room:
                    await client.recv_message_with(room, 5)
                else:
                    await client.recv_message(5)

        await _run(check_refused)

    await _run(check)
    await refused(0, 16)  # a receiver that made no room refuses any
    await refused(64, 65)


@pytest.mark.parametrize("header, error", [
    (HEADER.pack(MAGIC, PROTOCOL_VERSION, 0, MAX_FRAME + 1, 0), FrameTooLarge),
    (HEADER.pack(MAGIC, PROTOCOL_VERSION, FLAG_INLINE, transport.INLINE_MAX + 1, 0), ProtocolError),
    (HEADER.pack(MAGIC, PROTOCOL_VERSION, 0x80, 10, 0), ProtocolError),
    (HEADER.pack(MAGIC, PROTOCOL_VERSION, FLAG_TRAILING, 10, 10), ProtocolError),
    (HEADER.pack(MAGIC, PROTOCOL_VERSION, FLAG_INLINE | FLAG_TRAILING, 10, MAX_FRAME + 1), ProtocolError),
    (HEADER.pack(MAGIC, PROTOCOL_VERSION - 1, 0, 10, 0), ProtocolError),
    (b"\x00", ProtocolError),
], ids=["oversized", "inline-oversized", "unknown-flag", "trailing-not-inline", "trailing-oversized",
        "old-version", "short"])
async def test_bad_headers_are_refused_before_any_body_buffer(header: bytes, error: type[Exception]) -> None:
    async def check(client: transport.Connection, server: transport.Connection) -> None:
        allocated = []
        real_mmap = transport.mmap.mmap

        def spy(*args: Any) -> Any:
            allocated.append(args)
            return real_mmap(*args)

        transport.mmap.mmap = spy
        try:
            await client.send_raw(header)
            with pytest.raises(error):
                await server.recv_message(5)
        finally:
            transport.mmap.mmap = real_mmap
        assert not allocated, "a body buffer was allocated for a refused header"

    await _run(check)


def _sources(sizes: list[int], adjacent: bool) -> list[Any]:
    if adjacent:  # back to back in one buffer, as arena slots lie
        whole = bytearray(os.urandom(sum(sizes)))
        view, out, at = memoryview(whole), [], 0
        for n in sizes:
            out.append(view[at:at + n])
            at += n
        return out
    return [os.urandom(n) for n in sizes]


def _dests(sizes: list[int], adjacent: bool) -> list[Any]:
    if adjacent:
        whole = np.zeros(sum(sizes), dtype=np.uint8)
        out, at = [], 0
        for n in sizes:
            out.append(whole[at:at + n])
            at += n
        return out
    return [bytearray(n) for n in sizes]


MIXED = [64 * KIB] * 20 + [0, 5, 3 * 2**20, 100, 0] + [200 * KIB] * 7 + [transport.DIRECT_MIN, 8, 9]


@pytest.mark.parametrize("src_adjacent", [False, True], ids=["gathered", "spanned-source"])
@pytest.mark.parametrize("dst_adjacent", [False, True], ids=["scattered", "spanned-dest"])
async def test_payloads_of_mixed_sizes_arrive_bit_exact_both_ways(src_adjacent: bool, dst_adjacent: bool) -> None:
    async def check(client: transport.Connection, server: transport.Connection) -> None:
        for sender, receiver in ((server, client), (client, server)):
            sources = _sources(MIXED, src_adjacent)
            dests = _dests(MIXED, dst_adjacent)
            await asyncio.gather(sender.send_payloads(sources), receiver.recv_payloads(dests))
            assert [bytes(d) for d in dests] == [bytes(s) for s in sources]
            assert not sender.closed and not receiver.closed
        await client.send_message({"after": True})  # the stream is still in step
        assert await server.recv_message() == {"after": True}

    await _run(check)


@pytest.mark.parametrize("dst_adjacent", [False, True], ids=["scattered", "spanned-dest"])
async def test_each_run_of_payloads_is_reported_once_whole_and_in_order_while_later_ones_arrive(
        dst_adjacent: bool) -> None:
    async def check(client: transport.Connection, server: transport.Connection) -> None:
        sources = _sources(MIXED, True)
        dests = _dests(MIXED, dst_adjacent)
        runs: list[tuple[int, int]] = []
        whole_when_reported: list[bool] = []

        def landed(start: int, stop: int) -> None:
            runs.append((start, stop))
            whole_when_reported.append(all(bytes(dests[i]) == bytes(sources[i]) for i in range(start, stop)))

        await asyncio.gather(server.send_payloads(sources), client.recv_payloads(dests, landed=landed))
        assert all(whole_when_reported), "a run was reported before its bytes were all in place"
        reported = [i for start, stop in runs for i in range(start, stop)]
        assert reported == sorted(reported), "runs are reported in order, each once"
        assert set(reported) >= {i for i, n in enumerate(MIXED) if n}, "every non-empty buffer is in a run"
        assert len(runs) > 1, "runs are reported group by group, not once at the end"

    await _run(check)


@pytest.mark.parametrize(("size", "count", "groups"), [(64 * KIB, 3, None), (transport.GROUP_BYTES // 4, 4, [4])],
                         ids=["cut-by-sizes", "cut-as-announced"])
async def test_a_group_sent_one_block_per_message_is_refused_and_hands_on_nothing(
        size: int, count: int, groups: list[int] | None) -> None:
    """A group is one message: UCX does not say where a short one stopped, so its rest has no right offset.

    So too for a cut one side announced (a sender that sends other messages than it said).
    """
    async def check(client: transport.Connection, server: transport.Connection) -> None:
        blocks = [os.urandom(size) for _ in range(count)]
        dests = [bytearray(size) for _ in blocks]
        receive = asyncio.ensure_future(server.recv_payloads(dests, 10, groups=groups))
        with contextlib.suppress(DKVError):  # the receiver may have aborted already: then a send fails
            for block in blocks:  # one message per block
                await client.send_raw(block)
        with pytest.raises(DKVError, match="shorter than its group"):
            await receive
        assert server.closed
        assert all(not any(d) for d in dests), "no byte of a short group may reach a caller's buffer"

    await _run(check)


async def test_a_short_group_message_with_a_later_receive_posted_fails_and_hands_on_nothing() -> None:
    async def check(client: transport.Connection, server: transport.Connection) -> None:
        per_group = transport.GROUP_BYTES // (64 * KIB)
        dests = [bytearray(64 * KIB) for _ in range(per_group + 2)]  # two groups: both posted at once
        receive = asyncio.ensure_future(server.recv_payloads(dests, 10))
        await client.send_raw(os.urandom(64 * KIB))  # one block where a whole group was due
        with contextlib.suppress(DKVError):  # the receiver may have aborted already: then this send fails
            await client.send_raw(os.urandom(2 * 64 * KIB))
        with pytest.raises(DKVError):
            await receive
        assert server.closed
        assert all(not any(d) for d in dests), "no byte of a short group may reach a caller's buffer"

    await _run(check)


@pytest.mark.parametrize("dst_adjacent", [False, True], ids=["staged", "spanned-dest"])
async def test_a_payload_receive_that_times_out_leaves_nothing_landing_later(dst_adjacent: bool) -> None:
    async def check(client: transport.Connection, server: transport.Connection) -> None:
        sizes = [64 * KIB] * 8 + [transport.DIRECT_MIN]
        dests = _dests(sizes, dst_adjacent)
        with pytest.raises(DKVError, match="timed out"):
            await server.recv_payloads(dests, 0.3)
        assert server.closed, "the endpoint is aborted before the timeout is raised"
        before = [bytes(d) for d in dests]  # (a group received in place may hold its canaries)
        try:
            await client.send_payloads([os.urandom(n) for n in sizes], 2)  # the late bytes
        except DKVError:
            pass  # the peer is gone: fine
        await asyncio.sleep(0.5)
        assert [bytes(d) for d in dests] == before, "a late payload landed in a buffer after the timeout"

    await _run(check)


async def test_a_reply_sent_just_before_an_abort_still_reaches_the_peer() -> None:
    async def check(client: transport.Connection, server: transport.Connection) -> None:
        await server.send_message({"ok": False, "code": "protocol", "msg": "bye"})
        server.abort()  # at once, as a node does after an error reply
        assert server.closed
        assert (await client.recv_message(5))["msg"] == "bye"

    await _run(check)


async def test_a_send_to_a_peer_that_went_away_fails_at_the_next_operation_within_its_bound() -> None:
    async def check(client: transport.Connection, server: transport.Connection) -> None:
        server.abort()
        with pytest.raises(DKVError):
            for _ in range(3):  # the first may still be posted before the peer's end is known
                await client.send_message({"op": "x", "pad": os.urandom(100)}, 2)
                await client.recv_message(2)
        assert client.closed

    await _run(check)


# ---- progress driven by the loop (the default mode), and ucxx's thread mode across a connection ---

import time  # noqa: E402

from dkv.errors import OpTimeout  # noqa: E402
from dkv.event_loop import DEFAULT_EVENT_LOOP, EVENT_LOOP_ENV, EVENT_LOOPS  # noqa: E402

PEER = Path(__file__).with_name("transport_peer.py")
PEER_BOUND = 120.0


def _start_peer(tmp_path: Path, mode: str, event_loop: str = DEFAULT_EVENT_LOOP) -> tuple[subprocess.Popen[str], int]:
    """A transport_peer.py server in progress mode ``mode`` on ``event_loop``, and its port once it listens."""
    port_file = tmp_path / f"port-{mode}-{event_loop}"
    server = subprocess.Popen([sys.executable, str(PEER), "serve", str(port_file)], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env=_peer_env(mode, event_loop))
    deadline = time.monotonic() + PEER_BOUND
    while not port_file.exists():
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            raise AssertionError(f"the {mode} peer never listened: {server.communicate()[0][-3000:]}")
        time.sleep(0.05)
    return server, int(port_file.read_text())


def _peer_env(mode: str, event_loop: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "DKV_UCX_PROGRESS": mode, EVENT_LOOP_ENV: event_loop}


def _stop(server: subprocess.Popen[str]) -> None:
    if server.poll() is None:
        server.kill()
    server.communicate(timeout=30)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def test_ucx_is_progressed_by_the_loop_that_drives_it_unless_told_otherwise() -> None:
    async def mode() -> str | None:
        return transport.active_progress_mode()

    assert await on_ucx(mode()) == os.environ.get("DKV_UCX_PROGRESS", "loop")


@pytest.mark.parametrize("server_mode, client_mode, server_loop, client_loop", [
    ("loop", "thread", "uvloop", "uvloop"), ("thread", "loop", "uvloop", "uvloop"), ("loop", "loop", "uvloop", "uvloop"),
    ("loop", "loop", "uvloop", "asyncio"), ("loop", "loop", "asyncio", "uvloop"), ("thread", "loop", "asyncio", "uvloop"),
])
def test_peers_in_either_progress_mode_and_on_either_loop_handshake_and_exchange_bit_exact(
        tmp_path: Path, server_mode: str, client_mode: str, server_loop: str, client_loop: str) -> None:
    # the loop mode's handshake is dKV's own, on ucxx's raw requests: it must stay ucxx's on the wire,
    # and UCX must be driven alike by the standard loop and by uvloop (dkv.event_loop)
    server, port = _start_peer(tmp_path, server_mode, server_loop)
    try:
        done = subprocess.run([sys.executable, str(PEER), "ping", "127.0.0.1", str(port)], cwd=ROOT,
                              capture_output=True, text=True, timeout=PEER_BOUND,
                              env=_peer_env(client_mode, client_loop))
        assert done.returncode == 0 and done.stdout.strip().endswith(f"OK {client_mode} {client_loop}"), (
            done.stdout + done.stderr[-3000:])
        assert server.wait(PEER_BOUND) == 0, "the server must end cleanly once asked"
    finally:
        _stop(server)


@pytest.mark.parametrize("event_loop", EVENT_LOOPS)
async def test_a_loop_driven_server_waiting_on_a_receive_sleeps_instead_of_spinning(tmp_path: Path,
                                                                                     event_loop: str) -> None:
    server, port = _start_peer(tmp_path, "loop", event_loop)
    try:
        async def idle_cost() -> float:
            conn = await transport.connect("127.0.0.1", port)
            try:
                await conn.send_message({"op": "echo"})
                assert await conn.recv_message() == {"op": "echo"}
                before = _cpu_seconds(server.pid)  # the server now waits in a receive, as an idle node does
                await asyncio.sleep(3.0)
                used = _cpu_seconds(server.pid) - before
                await conn.send_message({"op": "bye"})
                await conn.recv_message()
                return used
            finally:
                await conn.close()

        used = await on_ucx(idle_cost())
        # a loop that yielded until the receive completed would take the whole 3 s of a core
        assert used < 1.0, f"an idle loop-driven server used {used:.2f} s of CPU in 3 s"
    finally:
        _stop(server)


@pytest.mark.skipif(os.environ.get("DKV_UCX_PROGRESS", "loop") != "loop", reason="loop-mode progress only")
async def test_a_progress_fault_between_pieces_of_work_is_left_to_the_tick_and_ucx_keeps_going() -> None:
    class FaultyWorker:
        def __init__(self, real: Any) -> None:
            self.real = real

        def progress(self) -> None:
            raise RuntimeError("injected UCX progress fault")

        def __getattr__(self, name: str) -> Any:
            return getattr(self.real, name)

    async def check(client: transport.Connection, server: transport.Connection) -> None:
        driver = transport._driver  # noqa: SLF001 - the fault is injected into the driver's own worker
        assert driver is not None
        deadline = time.monotonic() + 30
        while driver._queued:  # noqa: SLF001 - a queued pass would make progress_now() do nothing
            assert time.monotonic() < deadline, "the loop never ran its queued UCX pass"
            await asyncio.sleep(0.01)
        real = driver.worker
        driver.worker = FaultyWorker(real)
        try:
            transport.progress_now()  # long work on the loop calls this: a fault must not reach it
        finally:
            driver.worker = real
        await client.send_message({"op": "after the fault"})
        assert await server.recv_message(timeout=30) == {"op": "after the fault"}

    await _run(check)


async def test_a_receive_that_times_out_holds_its_buffer_until_ucx_cancels_it_then_lets_go() -> None:
    async def check(client: transport.Connection, server: transport.Connection) -> None:
        before = transport.pending_requests()
        with pytest.raises(OpTimeout):
            await server.recv_message(timeout=0.3)
        assert server.closed, "a timed-out receive aborts its connection"
        deadline = time.monotonic() + 30
        while transport.pending_requests() > before:  # the cancelled receive completes, its buffer goes
            assert time.monotonic() < deadline, f"{transport.pending_requests()} requests never completed"
            await asyncio.sleep(0.01)

    await _run(check)


@pytest.mark.parametrize("tls,rdma", [
    ("rc,tcp", True), ("rc_x", True), ("dc_mlx5,tcp", True), ("ud", True),
    ("tcp", False), ("tcp,sysv,posix,cma", False), ("sm,self", False),
])
def test_rdma_is_possible_where_ucx_tls_names_an_rdma_transport(monkeypatch, tls: str, rdma: bool) -> None:
    monkeypatch.setenv("UCX_TLS", tls)
    assert transport.rdma_possible() is rdma


def test_small_messages_go_eagerly_unless_rdma_may_carry_them_or_the_operator_chose() -> None:
    """A fresh interpreter: UCX_RNDV_THRESH as dkv.transport leaves it for UCX, for each environment."""
    def threshold(**env: str) -> str:
        clean = {k: v for k, v in os.environ.items() if k not in ("UCX_TLS", "UCX_RNDV_THRESH")}
        out = subprocess.run([sys.executable, "-c", "import os, dkv.transport; print(os.environ.get('UCX_RNDV_THRESH'))"],
                             env={**clean, **env}, capture_output=True, text=True, timeout=120, check=True)
        return out.stdout.strip()

    rdma_device = bool(os.path.isdir("/sys/class/infiniband") and os.listdir("/sys/class/infiniband"))
    assert (threshold() == "512k") is not rdma_device
    assert threshold(UCX_TLS="tcp") == "512k"
    assert threshold(UCX_TLS="rc,tcp") != "512k"  # ucxx's own default (8 KiB) stays
    assert threshold(UCX_RNDV_THRESH="64k") == "64k"
