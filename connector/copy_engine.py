"""Moves block rows between the engine's device tensors and host buffers.

A device block is one row of a 2-D ``uint8`` tensor ``[pages, bytes_per_page]``.

* **CPU tensors** (this machine, and tests): a row *is* host memory, so the
  network reads straight into it and writes straight out of it — no staging.
* **CUDA tensors**: loads land in pinned staging, then go host-to-device on the
  engine's side stream, with completion tracked by a CUDA event; offloads go
  device-to-host into pinned staging on that stream (after it waits for the
  compute stream), and the bytes leave for the node once the event fires.

The same calls serve both; only :meth:`CopyEngine.load_targets` and
:meth:`CopyEngine.offload_sources` look at the device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import torch


class Completion(Protocol):
    def is_done(self) -> bool: ...

    def wait(self) -> None: ...


class Done:
    """A completion that has already happened (CPU copies)."""

    def is_done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


class CudaEventCompletion:
    """Completion of work queued on a CUDA stream, observed through an event (never blocks in ``is_done``)."""

    def __init__(self, event: Any, keep_alive: Sequence[torch.Tensor] = ()) -> None:
        self._event = event
        self._keep_alive = list(keep_alive)  # staging must outlive the queued copies

    def is_done(self) -> bool:
        return bool(self._event.query())

    def wait(self) -> None:
        self._event.synchronize()


def host_buffer(row: torch.Tensor) -> Any:
    """A zero-copy buffer-protocol view of a contiguous CPU row."""
    return row.numpy()


Rows = Sequence[tuple[torch.Tensor, int]]  # (a leaf's shard tensor, block id): one device row each


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


class CopyEngine:
    """Copies for one device (see module docstring).

    Rows are named as ``(tensor, block id)`` pairs, so the caller's thread does
    no per-row work: views are made where the bytes move (the UCX loop thread).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self._numpy: dict[int, tuple[Any, int]] = {}

    def _cpu_views(self, rows: Rows) -> list[Any]:
        """A byte view of each row: a slice of one flat view of its tensor where the tensor is contiguous."""
        cache = self._numpy
        views = []
        for tensor, block_id in rows:
            entry = cache.get(id(tensor))
            if entry is None:
                entry = cache[id(tensor)] = _row_source(tensor)
            whole, row_bytes = entry
            views.append(whole[block_id * row_bytes:(block_id + 1) * row_bytes] if row_bytes else whole[block_id])
        return views

    def load_targets(self, rows: Rows) -> tuple[list[Any], Callable[[], Completion]]:
        """Host buffers the network fills for ``rows``, and a function that finishes the copy.

        Call the finisher once every buffer is filled (on any thread); it returns a
        :class:`Completion` that turns done when the rows hold the bytes.
        """
        if self._stream is None:
            return self._cpu_views(rows), Done
        device_rows = [tensor[block_id] for tensor, block_id in rows]
        staging = [torch.empty(r.numel(), dtype=torch.uint8, pin_memory=True) for r in device_rows]

        def finish() -> Completion:
            with torch.cuda.stream(self._stream):
                for row, host in zip(device_rows, staging):
                    row.copy_(host, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
            return CudaEventCompletion(event, staging)

        return [host_buffer(s) for s in staging], finish

    def offload_sources(self, rows: Callable[[], Rows]) -> tuple[Callable[[], list[Any]], Completion]:
        """A function giving host buffers with the rows' bytes once the returned completion is done.

        ``rows`` lists the rows when called. On CUDA it is called here and the
        device-to-host copies are queued here, on the caller's thread, behind
        the work already on the compute stream; on CPU nothing happens here:
        the rows are listed and viewed when the buffers are asked for.
        """
        if self._stream is None:
            return (lambda: self._cpu_views(rows())), Done()
        device_rows = [tensor[block_id] for tensor, block_id in rows()]
        staging = [torch.empty(r.numel(), dtype=torch.uint8, pin_memory=True) for r in device_rows]
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            for row, host in zip(device_rows, staging):
                host.copy_(row, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        return (lambda: [host_buffer(s) for s in staging]), CudaEventCompletion(event, staging)
