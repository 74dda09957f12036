#!/usr/bin/env python
"""Probe: the instructions a small load executes, in the node and in the client, counted by callgrind.

On this shared two-core machine a round trip's time swings by half from one
run to the next, more than most changes to the control path move it. The
instructions executed do not: the same code gives the same count within
about a percent. So a change to the path a small load takes is measured
here, and its time in the alternated probes and the bench.

One op is what ``scripts/bench.py`` times as its one-block load:
``DKVConnector.lookup`` of one held hash, then ``load`` of its block
(``--block-size``) until complete, over the connector's own direct channel:
same-host (``--path local``: the lookup answers where the block lies, the
client copies it) or on the listener path (``--path listener``: the node
sends the block with the lookup's answer, over its TCP control socket).
With ``--blocks N`` (N > 1) one op is the bench's batch load instead:
``start_lookup`` of N held hashes until answered, then ``load_lookup`` of
their N blocks until complete (the node's lookup, lease, slot map and
recency stamps per block; the client's plan and copy).

  node    the node runs under ``valgrind --tool=callgrind`` (every thread of
          its process); this process runs the client as usual.
  client  this script runs again under callgrind (``--client-run``): the
          client's whole process, every thread, against a node run as usual.
          There ``reply_spin`` is 0 (a spin's count is the time it waited,
          not work), and MAX's modules are kept out of the import: its native
          code uses instructions valgrind does not run, and the connector
          then uses its own types (the same code path).

Each counts only the ``--ops`` measured ops: instrumentation is switched on
(``callgrind_control -i on``) after ``--warmup`` ops, then zeroed after 100
more, and the counts dumped after the measured ones. It prints the
instructions per op, and with ``--top N`` the N C functions that executed
most of them (the interpreter's share shows as ``_PyEval_EvalFrameDefault``
and its helpers: how many Python calls and objects a path makes).

Needs valgrind (``apt install valgrind``). Every process it starts is
stopped by its PID.

Usage: probe_instructions.py [--side node|client|both] [--path local|listener] [--ops 1000] [--warmup 300]
                             [--block-size 64KiB] [--blocks 1] [--top 0] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TIMEOUT = 60.0  # each op's bound: the side under callgrind runs some 50 x slower
NODE_READY = 300.0  # a node under callgrind takes a minute or more to import and start here
CLIENT_RUN = 1800.0  # the client under callgrind: imports, warm-up, the ops
POOL_BYTES = 64 << 20  # the probe node's pool
ZEROED_AFTER = 100  # ops run instrumented before the counts are zeroed (the first instrumented ones translate code)


def _callgrind(out: Path) -> list[str]:
    return ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}"]


def _control(flag: str, pid: int) -> None:
    """``callgrind_control`` of ``pid``: ``-i on`` switches instrumentation on, ``-z`` zeroes, ``-d`` dumps."""
    subprocess.run(["callgrind_control", *flag.split(), str(pid)], check=True, capture_output=True, timeout=120)


def _dumped_total(out: Path) -> tuple[int, Path]:
    """The instructions of the dump ``-d`` made (the largest total among ``out``'s numbered parts) and its file."""
    best, where = -1, out
    for part in out.parent.glob(out.name + ".*"):
        for line in part.read_text(errors="replace").splitlines():
            if line.startswith(("totals:", "summary:")):
                count = int(line.split()[1])
                if count > best:
                    best, where = count, part
    if best < 0:
        raise SystemExit(f"no callgrind dump found next to {out}")
    return best, where


def _top(dump: Path, n: int) -> list[str]:
    """The ``n`` C functions that executed most instructions in ``dump`` (``callgrind_annotate``, self cost)."""
    text = subprocess.run(["callgrind_annotate", "--threshold=100", str(dump)], capture_output=True, text=True,
                          check=True, timeout=120).stdout
    rows = [line.strip() for line in text.splitlines() if line.strip()[:1].isdigit() and ":" in line]
    shown = []
    for row in rows[1:n + 1]:  # (the first is the program's total)
        count, _, where = row.partition("  ")
        where = where.strip().split(" [")[0]  # "file:function", without the library it is in
        path, _, function = where.rpartition(":")
        shown.append(f"{count.strip():>22}  {os.path.basename(path)}:{function}")
    return shown


class _NoMax:
    """A meta path finder that keeps MAX out of this process (see the module docstring, ``client``)."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "max" or name.startswith("max."):
            raise ImportError("MAX is kept out of a process run under valgrind")
        return None


def _loads(address: str, block_bytes: int, blocks: int, reply_spin: float | None,
           local: bool) -> tuple[Any, Any, Any]:
    """A writer that stored ``blocks`` blocks and a reader connector, on the node at ``address``; and the op to count."""
    import torch

    from bench_common import chained_hashes, store_through, wait_done
    from connector.dkv_connector import DKVConnector
    from connector.types import full_attention

    hashes = chained_hashes(blocks)
    ids = list(range(1, blocks + 1))
    writer = DKVConnector({"a": full_attention(0)}, [{"a": [torch.ones(blocks + 1, block_bytes, dtype=torch.uint8)]}],
                          namespace="probe", node=address, timeout=TIMEOUT)
    store_through(writer, "a", hashes, TIMEOUT)
    extra = {} if reply_spin is None else {"reply_spin": reply_spin}
    reader = DKVConnector({"a": full_attention(0)}, [{"a": [torch.zeros(blocks + 1, block_bytes, dtype=torch.uint8)]}],
                          namespace="probe", node=address, timeout=TIMEOUT, local=local, **extra)

    def one_block() -> None:
        if not reader.lookup(hashes)["a"][0]:
            raise SystemExit("the one-block lookup missed")
        wait_done(reader.load({"a": ids}, {"a": hashes}), "one-block load", TIMEOUT)

    def batch() -> None:  # as scripts/bench.py times a load of a batch
        handle = reader.start_lookup(hashes)
        wait_done(handle, "start_lookup", TIMEOUT)
        if not all(handle.result()["a"]):
            raise SystemExit("the batch lookup missed")
        wait_done(reader.load_lookup(handle, {"a": ids}, {"a": hashes}), "batch load", TIMEOUT)

    return writer, reader, one_block if blocks == 1 else batch


def _counted(pid: int, op: Any, ops: int, warmup: int) -> None:
    """``warmup`` ops, instrumentation on, ``ZEROED_AFTER`` more, counts zeroed, ``ops`` counted, dumped."""
    for _ in range(warmup):
        op()
    _control("-i on", pid)
    for _ in range(ZEROED_AFTER):
        op()
    _control("-z", pid)
    for _ in range(ops):
        op()
    _control("-d", pid)


def count_node(args: argparse.Namespace, work: Path) -> tuple[int, Path]:
    """The node's instructions over ``args.ops`` ops, with the node under callgrind and the client here."""
    from cluster.process import start_node

    out = work / "node.callgrind"
    node = start_node("--log-level", "WARNING", pool=str(POOL_BYTES), exit_with_parent=True, wrapper=_callgrind(out),
                      ready_timeout=NODE_READY)
    writer = reader = None
    try:
        writer, reader, op = _loads(node.address, args.block_bytes, args.blocks, None, args.path == "local")
        _counted(node.pid, op, args.ops, args.warmup)
    finally:
        for conn in (reader, writer):
            if conn is not None:
                conn.shutdown()
        node.stop()
    return _dumped_total(out)


def count_client(args: argparse.Namespace, work: Path) -> tuple[int, Path]:
    """The client's instructions over ``args.ops`` ops: this script again, under callgrind (``--client-run``)."""
    out = work / "client.callgrind"
    cmd = [*_callgrind(out), sys.executable, os.path.abspath(__file__), "--client-run", "--ops", str(args.ops),
           "--warmup", str(args.warmup), "--block-size", args.block_size, "--blocks", str(args.blocks),
           "--path", args.path]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    try:
        stdout, stderr = proc.communicate(timeout=CLIENT_RUN)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise SystemExit(f"the client under callgrind did not finish within {CLIENT_RUN:.0f} s") from None
    if "counted" not in stdout:  # (its exit status is valgrind's, whatever happened as the interpreter ended)
        raise SystemExit(f"the client under callgrind failed (exit {proc.returncode}):\n{stderr[-3000:]}")
    return _dumped_total(out)


def client_run(args: argparse.Namespace) -> int:
    """``--client-run``: this process is under callgrind; a node runs as usual, this client's ops are counted."""
    sys.meta_path.insert(0, _NoMax())
    from cluster.process import start_node

    node = start_node("--log-level", "WARNING", pool=str(POOL_BYTES), exit_with_parent=True)
    writer = reader = None
    try:
        writer, reader, op = _loads(node.address, args.block_bytes, args.blocks, 0.0, args.path == "local")
        _counted(os.getpid(), op, args.ops, args.warmup)
        print("counted", flush=True)
    finally:
        for conn in (reader, writer):
            if conn is not None:
                conn.shutdown()
        node.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", choices=("node", "client", "both"), default="both")
    parser.add_argument("--path", choices=("local", "listener"), default="local",
                        help="same-host (a slot map with the answer) or listener (the block with the answer)")
    parser.add_argument("--ops", type=int, default=1000, help="ops counted")
    parser.add_argument("--warmup", type=int, default=300, help="ops before instrumentation is switched on")
    parser.add_argument("--block-size", default="64KiB", help="the block's size (the bench's one-block load: 64KiB)")
    parser.add_argument("--blocks", type=int, default=1,
                        help="blocks a load: 1 (lookup + load), or more (start_lookup + load_lookup, as the bench)")
    parser.add_argument("--top", type=int, default=0, help="also the N C functions that executed the most")
    parser.add_argument("--json", help="also write the counts here")
    parser.add_argument("--client-run", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    from dkv.units import parse_size

    if args.ops < 1 or args.warmup < 0 or args.top < 0 or not 1 <= args.blocks <= 4096:
        parser.error("--ops >= 1, --warmup >= 0, --top >= 0, --blocks in [1, 4096]")
    args.block_bytes = parse_size(args.block_size)
    if args.block_bytes * (args.blocks + 1) > POOL_BYTES // 2:
        parser.error(f"--blocks x --block-size must stay under half the probe's pool ({POOL_BYTES >> 20} MiB)")
    if args.client_run:
        return client_run(args)
    for tool in ("valgrind", "callgrind_control", "callgrind_annotate"):
        if shutil.which(tool) is None:
            print(f"{tool} is not installed (apt install valgrind)", file=sys.stderr)
            return 2
    counts: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="dkv-instructions-") as work_dir:
        work = Path(work_dir)
        for side in ("node", "client") if args.side == "both" else (args.side,):
            started = time.monotonic()
            total, dump = (count_node if side == "node" else count_client)(args, work)
            counts[side] = total // args.ops
            what = "one-block loads" if args.blocks == 1 else f"loads of {args.blocks} blocks"
            print(f"{side:6s} {counts[side]:>10,} instructions per op  ({args.ops} {what} of "
                  f"{args.block_size}, {args.path} path, {time.monotonic() - started:.0f} s under callgrind)",
                  flush=True)
            for row in _top(dump, args.top):
                print(f"         {row}")
    if args.json:
        Path(args.json).write_text(json.dumps({"ops": args.ops, "block_size": args.block_size, "blocks": args.blocks,
                                               "path": args.path,
                                               "instructions_per_op": counts}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
