"""The copy engine: rows between device tensors and host buffers, batched per shard tensor.

The staged path (one staging tensor per transfer, slice copies per run of
contiguous block ids, or one scatter/gather past ``DIRECT_RUNS_MAX`` runs) runs
on CPU tensors here and on CUDA tensors where a GPU is present (the same tests,
``cuda`` parameter); ``scripts/device_check.py`` runs it against a real node.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from connector.copy_engine import DIRECT_RUNS_MAX, CopyEngine, Done, id_runs, lay_out

CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="no CUDA device here"))]

CONTIGUOUS = [3, 4, 5, 6, 7]
SCATTERED = [9, 2, 14, 5, 11, 7, 1, 12]  # more runs than DIRECT_RUNS_MAX: one scatter/gather
assert len(id_runs(SCATTERED)) > DIRECT_RUNS_MAX


def test_runs_of_consecutive_block_ids() -> None:
    assert id_runs([]) == []
    assert id_runs([5]) == [(0, 5, 1)]
    assert id_runs([3, 4, 5, 6]) == [(0, 3, 4)]
    assert id_runs([3, 4, 5, 9, 10, 2]) == [(0, 3, 3), (3, 9, 2), (5, 2, 1)]
    assert id_runs([4, 3, 2, 5]) == [(0, 4, 1), (1, 3, 1), (2, 2, 1), (3, 5, 1)]  # a permutation of a range


def test_row_groups_are_laid_back_to_back_in_one_staging() -> None:
    a, b = torch.zeros(8, 16, dtype=torch.uint8), torch.zeros(8, 48, dtype=torch.uint8)
    laid, nbytes = lay_out([(a, [1, 2]), (b, [1, 5, 6])])
    assert [(g.tensor is a, g.block_ids, g.offset, g.row_bytes) for g in laid] == [
        (True, [1, 2], 0, 16), (False, [1, 5, 6], 32, 48)]
    assert nbytes == 32 + 3 * 48
    assert lay_out([]) == ([], 0)


def _shards(device: str, pages: int = 16) -> list[torch.Tensor]:
    """Two shard tensors of different row sizes, as a leaf of two TP shards would have."""
    return [torch.zeros(pages, 4096, dtype=torch.uint8, device=device),
            torch.zeros(pages, 1024, dtype=torch.uint8, device=device)]


def _engine(device: str) -> CopyEngine:
    return CopyEngine(torch.device(device), staged=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_ids", [CONTIGUOUS, SCATTERED], ids=["slice-copies", "one-scatter"])
def test_a_staged_load_puts_each_buffers_bytes_in_its_row_and_nowhere_else(device: str, block_ids: list[int]) -> None:
    engine = _engine(device)
    shards = _shards(device)
    groups = [(t, block_ids) for t in shards]
    rows = [(t, i) for t, ids in groups for i in ids]
    targets, finish = engine.load_targets(groups)
    assert [memoryview(t).nbytes for t in targets] == [t[0].numel() for t, _ in rows]
    expected = [torch.randint(0, 256, (t[0].numel(),), dtype=torch.uint8) for t, _ in rows]
    for target, data in zip(targets, expected):
        memoryview(target)[:] = data.numpy().tobytes()
    completion = finish()
    completion.wait()
    assert completion.is_done()
    for (tensor, block_id), data in zip(rows, expected):
        assert torch.equal(tensor[block_id].cpu(), data)
    untouched = [i for i in range(16) if i not in block_ids]
    for tensor in shards:
        assert not tensor[untouched].any(), "a row outside the load was written"
    engine.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_ids", [CONTIGUOUS, SCATTERED], ids=["slice-copies", "one-gather"])
def test_a_staged_offload_gives_each_rows_bytes_in_order(device: str, block_ids: list[int]) -> None:
    engine = _engine(device)
    shards = _shards(device)
    for tensor in shards:
        tensor.copy_(torch.randint(0, 256, tensor.shape, dtype=torch.uint8, device=device))
    groups = [(t, block_ids) for t in shards]
    rows = [(t, i) for t, ids in groups for i in ids]
    start = engine.offload_sources(lambda: groups)
    completion, sources = start()
    asyncio.run(completion.settled())  # CUDA: woken by the event on the waiter thread
    assert completion.is_done()
    got = sources()
    assert len(got) == len(rows)
    for (tensor, block_id), buffer in zip(rows, got):
        assert bytes(memoryview(buffer)) == tensor[block_id].cpu().numpy().tobytes()
    engine.close()


def test_unstaged_cpu_rows_are_the_buffers_themselves() -> None:
    engine = CopyEngine(torch.device("cpu"))
    assert not engine.staged
    tensor = torch.zeros(8, 64, dtype=torch.uint8)
    targets, finish = engine.load_targets([(tensor, [3, 5])])
    memoryview(targets[1])[:] = b"\x07" * 64
    assert isinstance(finish(), Done)
    assert bool((tensor[5] == 7).all()) and not tensor[3].any()
    done, sources = engine.offload_sources(lambda: [(tensor, [5])])()
    assert done.is_done() and bytes(memoryview(sources()[0])) == b"\x07" * 64


@pytest.mark.skipif(not CUDA, reason="no CUDA device here")
def test_an_offload_copies_what_the_compute_stream_wrote_before_the_call_even_when_started_later() -> None:
    """The call fences the compute stream; the copy queued later (the loop thread) waits for that fence."""
    engine = _engine("cuda")
    tensor = torch.zeros(64, 1 << 20, dtype=torch.uint8, device="cuda")
    torch.cuda._sleep(50_000_000)  # keep the compute stream busy, so the write below lands late
    tensor[1:33].fill_(0xAB)
    start = engine.offload_sources(lambda: [(tensor, list(range(1, 33)))])
    completion, sources = start()
    completion.wait()
    assert all(bytes(memoryview(b)) == b"\xab" * (1 << 20) for b in sources())
    engine.close()
