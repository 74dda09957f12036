"""Moves block rows between the engine's device tensors and host buffers.

A device block is one row of a 2-D ``uint8`` tensor ``[pages, bytes_per_page]``.

* **CPU tensors** (this machine, and tests): a row *is* host memory, so the
  network reads straight into it and writes straight out of it — no staging.
* **CUDA tensors**: one pinned staging tensor per transfer, the rows laid back
  to back in it. The network (or the same-host checked copy) fills it and the
  device copies run on the engine's side stream; offloads copy device-to-host
  into it on that stream and the bytes leave for the node once the stream's
  event fires. The scheduler thread only records a fence on its compute
  stream (``offload`` returns in microseconds); the loop thread queues the
  copies behind that fence. That is safe because an offload's source rows
  stay pinned (``g0_blocks_per_leaf``) until the transfer completes: nothing
  the engine queues after the call may write them.

Device copies are batched per shard tensor: rows whose block ids run on
(``first..first+n``) move as one slice copy, so a run of contiguous blocks is
one DMA straight between the staging and the device rows; a transfer of more
than :data:`DIRECT_RUNS_MAX` runs in one tensor moves as one DMA of its whole
staging plus one scatter (``index_copy_``) or gather (``index_select``) on the
device. Launches per transfer stay flat as block counts grow.

Completion is learnt without a spin: events are made with blocking sync, and
:meth:`Completion.settled` waits for one on the engine's single waiter thread,
asleep in the driver until the copy lands (FIFO, as the copies on one stream
land in order). The scheduler's own polls (``is_done``) only query.

The staged path runs on CPU tensors too (``CopyEngine(device, staged=True)``,
unpinned and synchronous), so its batching is tested without a GPU.

Why the same-host path stages on CUDA as well: a read's bytes are checked
against the writer's checksum where the caller got them (:mod:`dkv.checksum`,
``LeaseSlots.copy``); a DMA straight out of the slot would leave the device
rows unchecked, and the namespace's segment is a sparse mapping of up to the
pool's size that registering with CUDA would pin whole. The checked copy into
pinned staging is the one copy the check needs; the device copy from there is
DMA.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

# runs of contiguous block ids in one tensor copied as slices; more are one DMA + one scatter/gather
DIRECT_RUNS_MAX = 4


class Completion(Protocol):
    def is_done(self) -> bool: ...

    def wait(self) -> None: ...

    async def settled(self) -> None: ...


class Done:
    """A completion that has already happened (CPU copies)."""

    def is_done(self) -> bool:
        return True

    def wait(self) -> None:
        return None

    async def settled(self) -> None:
        return None


class CudaEventCompletion:
    """Completion of work queued on a CUDA stream, observed through a blocking-sync event.

    ``is_done`` only queries (never blocks); ``wait`` sleeps in the driver
    until the event fires; ``settled`` does that on ``waiter`` (one thread)
    and resumes the awaiting loop then: no polling anywhere. Once any of
    them saw the event, the staging it kept alive is let go: a transfer kept
    on the engine's books must not keep pinned memory out of torch's cache
    (a fresh pinned allocation costs milliseconds).
    """

    def __init__(self, event: Any, waiter: concurrent.futures.Executor,
                 keep_alive: Sequence[torch.Tensor] = ()) -> None:
        self._event = event
        self._waiter = waiter
        self._keep_alive = list(keep_alive)  # staging must outlive the queued copies

    def is_done(self) -> bool:
        if not self._event.query():
            return False
        self._keep_alive = []  # staging goes back to torch's pinned cache now, not when the transfer is dropped
        return True

    def wait(self) -> None:
        self._event.synchronize()
        self._keep_alive = []

    async def settled(self) -> None:
        if not self._event.query():
            await asyncio.get_running_loop().run_in_executor(self._waiter, self._event.synchronize)
        self._keep_alive = []


# (a leaf's shard tensor, its block ids): the rows of one transfer, tensor by tensor, in the keys' order
RowGroups = Sequence[tuple[torch.Tensor, Sequence[int]]]
# an offload's second step (the loop thread): queue the device copy; returns its completion and the host buffers
OffloadStart = Callable[[], tuple["Completion", Callable[[], list[Any]]]]


def _row_source(tensor: torch.Tensor) -> tuple[Any, int]:
    """What rows of a CPU tensor are cut from: ``(flat byte view, row bytes)``, or ``(array, 0)`` to index.

    A slice of a flat memoryview costs a fraction of a numpy row and its
    memoryview, per row of every transfer; a tensor whose rows do not lie
    back to back is indexed as an array.
    """
    array = tensor.numpy()
    if array.ndim >= 1 and array.flags.c_contiguous and array.shape[0]:
        return memoryview(array.reshape(-1).view(np.uint8)), array.nbytes // array.shape[0]
    return array, 0


@dataclass(slots=True)
class RowGroup:
    """Consecutive rows of one transfer in one shard tensor, and where they lie in the staging."""

    tensor: torch.Tensor
    block_ids: list[int]
    offset: int  # bytes into the staging
    row_bytes: int

    @property
    def nbytes(self) -> int:
        return len(self.block_ids) * self.row_bytes


def lay_out(groups: RowGroups) -> tuple[list[RowGroup], int]:
    """``groups`` laid back to back in one staging: ``(groups with their offsets, total bytes)``."""
    laid: list[RowGroup] = []
    offset = 0
    for tensor, block_ids in groups:
        group = RowGroup(tensor, list(block_ids), offset, tensor[0].numel() * tensor.element_size())
        laid.append(group)
        offset += group.nbytes
    return laid, offset


def id_runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Runs of consecutive ids: ``(index of the run's first row, its first block id, rows)`` each."""
    n = len(block_ids)
    if not n:
        return []
    first = block_ids[0]
    if block_ids[-1] - first == n - 1 and list(block_ids) == list(range(first, first + n)):
        return [(0, first, n)]  # the common case: one ascending run, checked without a Python loop
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, n + 1):
        if i == n or block_ids[i] != block_ids[i - 1] + 1:
            runs.append((start, block_ids[start], i - start))
            start = i
    return runs


class CopyEngine:
    """Copies for one device (see module docstring).

    Rows are named as ``(tensor, block ids)`` groups, so no thread does work
    per row but where bytes move: views are made on the UCX loop thread, and
    device copies are queued per run of block ids.
    """

    def __init__(self, device: torch.device, *, staged: bool | None = None) -> None:
        self.device = device
        self.staged = device.type == "cuda" if staged is None else staged
        self._cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device=device) if self._cuda else None
        self._waiter = (concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dkv-copy-wait")
                        if self._cuda else None)
        self._numpy: dict[int, tuple[Any, int]] = {}

    def close(self) -> None:
        """Stop the waiter thread (a wait in progress ends when its copy lands); later waits fail."""
        if self._waiter is not None:
            self._waiter.shutdown(wait=False, cancel_futures=True)

    def _source(self, tensor: torch.Tensor) -> tuple[Any, int]:
        """:func:`_row_source` of a CPU tensor, made once per tensor."""
        entry = self._numpy.get(id(tensor))
        if entry is None:
            entry = self._numpy[id(tensor)] = _row_source(tensor)
        return entry

    def _cpu_views(self, groups: RowGroups) -> list[Any]:
        """A byte view of each row: a slice of one flat view of its tensor where the tensor is contiguous."""
        views: list[Any] = []
        for tensor, block_ids in groups:
            whole, n = self._source(tensor)
            views += [whole[i * n:(i + 1) * n] for i in block_ids] if n else [whole[i] for i in block_ids]
        return views

    def flat_rows(self, tensor: torch.Tensor) -> tuple[Any, int] | None:
        """Rows filled in place that lie back to back: ``(one flat writable byte view of them all, row bytes)``.

        ``None`` for staged rows (CUDA) and for a tensor whose rows are not
        contiguous: fill those through :meth:`load_targets`.
        """
        if self.staged:
            return None
        whole, n = self._source(tensor)
        return (whole, n) if n else None

    # ---- the staged path ---------------------------------------------------------------------------

    def _staging(self, nbytes: int) -> torch.Tensor:
        """One flat host tensor for a transfer's rows: pinned on CUDA (from torch's caching host allocator)."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._cuda)

    def _stream_context(self) -> Any:
        return torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()

    def _index(self, block_ids: list[int]) -> torch.Tensor:
        """The block ids as an int64 tensor on the device (through pinned memory on CUDA: an async copy)."""
        ids = torch.tensor(block_ids, dtype=torch.int64)
        if not self._cuda:
            return ids
        return ids.pin_memory().to(self.device, non_blocking=True)

    def _completion(self, keep_alive: Sequence[torch.Tensor]) -> Completion:
        if self._stream is None:
            return Done()
        event = torch.cuda.Event(blocking=True)
        event.record(self._stream)
        assert self._waiter is not None
        return CudaEventCompletion(event, self._waiter, keep_alive)

    @staticmethod
    def _group_view(staging: torch.Tensor, group: RowGroup) -> torch.Tensor:
        """The staging's bytes of ``group`` as ``[rows, row bytes]`` in the tensor's shape."""
        flat = staging[group.offset:group.offset + group.nbytes]
        return flat.view(group.tensor.dtype).view(len(group.block_ids), *group.tensor.shape[1:])

    def _move(self, staging: torch.Tensor, groups: list[RowGroup], *, to_device: bool) -> list[torch.Tensor]:
        """Queue staging -> device rows (``to_device``) or back, on the side stream; returns what must outlive it.

        A group of at most :data:`DIRECT_RUNS_MAX` runs of block ids moves as
        one slice copy per run; a longer one as one DMA of its whole staging
        and one scatter (``index_copy_``) or gather (``index_select``) on the device.
        """
        keep: list[torch.Tensor] = []
        for group in groups:
            host, rows = self._group_view(staging, group), group.tensor
            runs = id_runs(group.block_ids)
            if len(runs) <= DIRECT_RUNS_MAX:
                for index, first, count in runs:
                    if to_device:
                        rows[first:first + count].copy_(host[index:index + count], non_blocking=True)
                    else:
                        host[index:index + count].copy_(rows[first:first + count], non_blocking=True)
            elif to_device:
                on_device, index = host.to(self.device, non_blocking=True), self._index(group.block_ids)
                rows.index_copy_(0, index, on_device)
                keep += (on_device, index)
            else:
                gathered = rows.index_select(0, self._index(group.block_ids))
                host.copy_(gathered, non_blocking=True)
                keep.append(gathered)
        return keep

    @staticmethod
    def _host_views(staging: torch.Tensor, groups: list[RowGroup]) -> list[memoryview]:
        """One byte view per row of the staging, in the rows' order."""
        whole = memoryview(staging.numpy())
        return [whole[g.offset + i * g.row_bytes:g.offset + (i + 1) * g.row_bytes]
                for g in groups for i in range(len(g.block_ids))]

    # ---- the two directions ------------------------------------------------------------------------

    def load_targets(self, groups: RowGroups) -> tuple[list[Any], Callable[[], Completion]]:
        """Host buffers the network fills for the rows, and a function that finishes the copy.

        Call the finisher once every buffer is filled (on any thread); it returns a
        :class:`Completion` that turns done when the rows hold the bytes.
        """
        if not self.staged:
            return self._cpu_views(groups), Done
        laid, nbytes = lay_out(groups)
        staging = self._staging(nbytes)

        def finish() -> Completion:
            with self._stream_context():
                keep = self._move(staging, laid, to_device=True)
                return self._completion([staging, *keep])

        return self._host_views(staging, laid), finish

    def offload_sources(self, groups: Callable[[], RowGroups]) -> OffloadStart:
        """Fence the rows' bytes now (the caller's thread); the returned ``start`` copies them out later.

        ``start()`` (the loop thread) returns a completion and a function giving
        host buffers with the rows' bytes once that completion is done. On CUDA
        the call records an event on the caller's current (compute) stream and
        ``start`` queues the device-to-host copies on the side stream behind
        it, so they read what the work queued before the call wrote; on CPU
        nothing happens until the buffers are asked for (they are the rows).
        """
        if not self.staged:
            return lambda: (Done(), lambda: self._cpu_views(groups()))
        fence = None
        if self._stream is not None:
            fence = torch.cuda.Event()
            fence.record(torch.cuda.current_stream(self.device))

        def start() -> tuple[Completion, Callable[[], list[Any]]]:
            laid, nbytes = lay_out(groups())
            staging = self._staging(nbytes)
            with self._stream_context():
                if fence is not None:
                    self._stream.wait_event(fence)  # type: ignore[union-attr]
                keep = self._move(staging, laid, to_device=False)
                completion = self._completion([staging, *keep])
            return completion, lambda: self._host_views(staging, laid)

        return start
