"""The native receive of a read's blocks into rows (``dkv._checked_copy.recv_rows``), over a real socket pair.

It receives blocks back to back from a stream socket, each into its row,
hashes each as its bytes land and says per block whether it matched the
writer's checksum: the same checksum ``dkv.checksum.block_checksum`` gives.
These pin the bytes (however the stream cuts them, with bytes already read
before it is called), the verdicts (a flipped bit fails its block only), and
every way the stream can end early (bounded by the timeout, never a hang),
with its arguments checked before a byte is read.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from dkv.checksum import block_checksum, block_head

pytestmark = pytest.mark.timeout(60)

ROW = 64 * 1024
LEAF = "full"


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def _recv_rows():
    """``recv_rows`` of one target, as most of these call it."""
    from dkv._checked_copy import recv_rows

    def one(fd, rows, row_bytes, ids, sums, head, hashes, first, timeout):  # noqa: ANN001, ANN202
        return recv_rows(fd, [(rows, row_bytes, ids, head, hashes)], sums, first, timeout)

    return one


def _blocks(n: int, row: int = ROW, hash_length: int = 32) -> tuple[list[bytes], list[bytes], bytes]:
    hashes = [os.urandom(hash_length) for _ in range(n)]
    data = [os.urandom(row) for _ in range(n)]
    sums = b"".join(block_checksum(LEAF, 0, h, d) for h, d in zip(hashes, data))
    return hashes, data, sums


def _send_in_pieces(sock: socket.socket, payload: bytes, piece: int, pause: float = 0.0) -> threading.Thread:
    def run() -> None:
        for at in range(0, len(payload), piece):
            sock.sendall(payload[at:at + piece])
            if pause:
                time.sleep(pause)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("piece", [1000, ROW, 3 * ROW + 17])
@pytest.mark.parametrize("first", [0, 100, ROW + 5])
@pytest.mark.parametrize("hash_length", [8, 32])
def test_blocks_land_in_their_rows_and_each_matches_however_the_stream_cuts_them(
        pair, piece: int, first: int, hash_length: int) -> None:
    a, b = pair
    n = 5
    hashes, data, sums = _blocks(n, hash_length=hash_length)
    rows = np.zeros((n + 3, ROW), np.uint8)
    ids = [6, 1, 4, 2, 7]  # in any order
    payload = b"".join(data)
    sender = _send_in_pieces(a, payload[first:], piece)
    verdicts = _recv_rows()(b.fileno(), memoryview(rows).cast("B"), ROW, ids, sums,
                            block_head(LEAF, 0, ROW, hash_length), hashes, payload[:first], 10.0)
    sender.join(10)
    assert verdicts == b"\x01" * n
    for i, row in enumerate(ids):
        assert rows[row].tobytes() == data[i]
    assert not rows[[0, 3, 5]].any(), "a row no block names was written"


def test_a_flipped_bit_fails_its_block_only_and_the_stream_stays_in_step(pair) -> None:
    a, b = pair
    hashes, data, sums = _blocks(3)
    corrupted = bytearray(data[1])
    corrupted[ROW // 2] ^= 1
    a.sendall(data[0] + bytes(corrupted) + data[2] + b"next")
    rows = np.zeros((4, ROW), np.uint8)
    verdicts = _recv_rows()(b.fileno(), memoryview(rows).cast("B"), ROW, [1, 2, 3], sums, block_head(LEAF, 0, ROW, 32),
                            hashes, b"", 10.0)
    assert verdicts == b"\x01\x00\x01"
    assert b.recv(16) == b"next", "it read past its blocks"


def test_a_block_under_another_hash_fails_its_checksum(pair) -> None:
    a, b = pair
    hashes, data, sums = _blocks(2)
    a.sendall(data[0] + data[1])
    rows = np.zeros((3, ROW), np.uint8)
    verdicts = _recv_rows()(b.fileno(), memoryview(rows).cast("B"), ROW, [1, 2], sums, block_head(LEAF, 0, ROW, 32),
                            [hashes[1], hashes[0]], b"", 10.0)
    assert verdicts == b"\x00\x00"


def test_a_stream_that_ends_early_is_a_connection_error(pair) -> None:
    a, b = pair
    hashes, data, sums = _blocks(2)
    a.sendall(data[0] + data[1][:100])
    a.shutdown(socket.SHUT_WR)
    rows = np.zeros((3, ROW), np.uint8)
    with pytest.raises(ConnectionResetError):
        _recv_rows()(b.fileno(), memoryview(rows).cast("B"), ROW, [1, 2], sums, block_head(LEAF, 0, ROW, 32), hashes,
                     b"", 10.0)


def test_a_stream_that_stalls_times_out_within_its_bound(pair) -> None:
    a, b = pair
    hashes, data, sums = _blocks(2)
    a.sendall(data[0])  # the second never comes
    rows = np.zeros((3, ROW), np.uint8)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        _recv_rows()(b.fileno(), memoryview(rows).cast("B"), ROW, [1, 2], sums, block_head(LEAF, 0, ROW, 32), hashes,
                     b"", 0.3)
    assert time.monotonic() - started < 10  # 0.3 s, generously on a noisy machine


def test_a_shutdown_from_another_thread_ends_a_waiting_receive(pair) -> None:
    a, b = pair
    hashes, _, sums = _blocks(2)
    rows = np.zeros((3, ROW), np.uint8)
    timer = threading.Timer(0.2, b.shutdown, (socket.SHUT_RDWR,))
    timer.start()
    try:
        with pytest.raises(ConnectionResetError):
            _recv_rows()(b.fileno(), memoryview(rows).cast("B"), ROW, [1, 2], sums, block_head(LEAF, 0, ROW, 32),
                         hashes, b"", 30.0)
    finally:
        timer.cancel()


@pytest.mark.parametrize("case", ["row outside", "row twice", "negative row", "sums short", "hash lengths differ",
                                  "ids and hashes differ", "no rows", "read-only rows", "negative timeout"])
def test_bad_arguments_are_refused_before_a_byte_is_read(pair, case: str) -> None:
    a, b = pair
    hashes, data, sums = _blocks(2)
    a.sendall(data[0] + data[1])
    rows: object = memoryview(np.zeros((3, ROW), np.uint8)).cast("B")
    ids, row, timeout = [1, 2], ROW, 5.0
    if case == "row outside":
        ids = [1, 3]
    elif case == "row twice":
        ids = [2, 2]
    elif case == "negative row":
        ids = [-1, 1]
    elif case == "sums short":
        sums = sums[:-1]
    elif case == "hash lengths differ":
        hashes = [hashes[0], hashes[1][:8]]
    elif case == "ids and hashes differ":
        ids = [1]
    elif case == "no rows":
        row = 0
    elif case == "read-only rows":
        rows = bytes(3 * ROW)
    elif case == "negative timeout":
        timeout = -1.0
    with pytest.raises((ValueError, TypeError, BufferError)):
        _recv_rows()(b.fileno(), rows, row, ids, sums, block_head(LEAF, 0, ROW, 32), hashes, b"", timeout)
    assert len(b.recv(2 * ROW, socket.MSG_PEEK | socket.MSG_WAITALL)) == 2 * ROW, "it read before refusing"


def test_several_targets_take_their_blocks_in_turn_each_with_its_own_rows_and_prefix(pair) -> None:
    from dkv._checked_copy import recv_rows

    a, b = pair
    small, large = 16 * 1024, ROW
    h1, d1 = [os.urandom(32) for _ in range(3)], [os.urandom(small) for _ in range(3)]
    h2, d2 = [os.urandom(8) for _ in range(2)], [os.urandom(large) for _ in range(2)]
    sums = b"".join([block_checksum("swa", 0, h, d) for h, d in zip(h1, d1)]
                    + [block_checksum("full", 1, h, d) for h, d in zip(h2, d2)])
    rows1, rows2 = np.zeros((4, small), np.uint8), np.zeros((3, large), np.uint8)
    sender = _send_in_pieces(a, b"".join(d1 + d2)[50:], 5000)
    verdicts = recv_rows(b.fileno(), [(memoryview(rows1).cast("B"), small, [3, 1, 2], block_head("swa", 0, small, 32), h1),
                                      (memoryview(rows2).cast("B"), large, [2, 1], block_head("full", 1, large, 8), h2)],
                         sums, b"".join(d1 + d2)[:50], 10.0)
    sender.join(10)
    assert verdicts == b"\x01" * 5
    assert [rows1[i].tobytes() for i in (3, 1, 2)] == d1 and [rows2[i].tobytes() for i in (2, 1)] == d2


def test_two_targets_over_the_same_rows_may_not_name_one_row_twice(pair) -> None:
    from dkv._checked_copy import recv_rows

    a, b = pair
    hashes, data, sums = _blocks(2)
    a.sendall(data[0] + data[1])
    rows = memoryview(np.zeros((3, ROW), np.uint8)).cast("B")
    head = block_head(LEAF, 0, ROW, 32)
    with pytest.raises(ValueError, match="same row"):
        recv_rows(b.fileno(), [(rows, ROW, [1], head, hashes[:1]), (rows, ROW, [1], head, hashes[1:])], sums, b"", 5.0)
    with pytest.raises(ValueError):  # more checksums than blocks
        recv_rows(b.fileno(), [(rows, ROW, [1], head, hashes[:1])], sums, b"", 5.0)
    with pytest.raises(TypeError):
        recv_rows(b.fileno(), [(rows, ROW, [1], head)], sums[:16], b"", 5.0)
    assert len(b.recv(2 * ROW, socket.MSG_PEEK | socket.MSG_WAITALL)) == 2 * ROW, "it read before refusing"
