"""Benchmark the block store alone: is the cost of each op flat after a million operations?

DESIGN §6: "costs that grow with history are bugs". This drives one
:class:`dkv.store.Store` over a real :class:`dkv.arena.Arena` (64 MiB of 16 KiB
blocks by default, so eviction runs all the time) through a serving-like mix of
operations, using only the store's public methods, and times every call:

* ``write``   - reserve a conversation's newest run (its already held blocks come back ``exists``) and commit it
* ``lookup``  - a leased lookup of a run of 64-256 hashes (the conversation's chain, then blocks not written yet)
* ``read``    - the read under a lease: ``begin_read`` + ``end_read`` (``read_plan`` on stores that have it), then ``end_lease``
* ``abandon`` - ``end_lease`` without a read
* ``touch``   - the conversation's whole chain from its root
* ``probe``   - ``presence`` of a run, no lease
* ``expire``  - the node's periodic expiry
* ``stats``   - the accounting a ``stats`` reply reads (``host_bytes``, ``disk_bytes``, counters, table sizes)
* ``baseline`` - fixed work that never touches the store (128 keys built and looked up in a fixed dict):
  its ratio is the machine's own drift between the windows, to read the others against

Two scenarios (``--scenario``, default both, each ``--ops`` ops):

* ``churn``    - 64 conversations that keep growing and starting over: the working set is several
  times the pool, every new block evicts one (a busy node, low hit rate);
* ``resident`` - a few conversations whose blocks all fit in the pool: once written, writes find
  their blocks held, nothing is evicted, and lookups, reads and touches restamp the same blocks
  forever (a node whose pool holds the hot set). History-bound costs that eviction would hide
  (a recency structure that grows with every restamp) show here.

The clock is simulated (``--tick`` seconds per op), so leases expire as they would
at that op rate and the run is reproducible for a seed. A warm-up (``--warmup``
ops, untimed; by default at least twice the store's longest TTL in simulated time)
first fills the arena, grows the conversations to their steady lengths and lets
leases, reads and reservations start expiring at their steady rate; then ``--ops``
ops are timed in windows (``--window``, default a tenth of
them). The table shows each op's p50 in the first and the last window and their
ratio (about 1 when the cost is flat).

    python scripts/bench_store.py [--ops 1000000 | --quick] [--scenario both|churn|resident] [--pool 64MiB]
                                  [--block 16KiB] [--json out.json]
"""

from __future__ import annotations

import argparse
import array
import itertools
import json
import os
import platform
import random
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from dkv.arena import Arena  # noqa: E402
from dkv.store import WRITE, Store, StoreKey  # noqa: E402
from dkv.units import format_size, parse_size  # noqa: E402

NS = "bench/store"
LEAVES = ("full", "swa")
SHARDS = 1
OPS = ("write", "lookup", "read", "abandon", "touch", "probe", "expire", "stats", "baseline")
MIX = {"write": 25, "lookup": 20, "read": 15, "abandon": 4, "touch": 14, "probe": 12, "expire": 5, "stats": 4,
       "baseline": 1}
MAX_CHAIN = 256  # a conversation longer than this starts over (a new chain)
OWNERS = 16  # clients
GROUPS = 4  # lease groups per client (replicas)


class Clock:
    """Simulated time: advanced by the driver, one tick per op."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Workload:
    """Conversations (prefix-chained hashes) growing, looked up, read, touched; the store under test."""

    def __init__(self, store: Store, block: int, conversations: int, seed: int, *, resident: bool = False) -> None:
        self.store = store
        self.resident = resident  # chains stop at MAX_CHAIN instead of starting over
        self.block = block
        self.rng = random.Random(seed)
        self.chains: list[list[bytes]] = [[] for _ in range(conversations)]
        # popularity is Zipf-like (a few hot conversations, a long tail), so the cache has a working set
        self._popularity = list(itertools.accumulate(1.0 / (i + 1) for i in range(conversations)))
        self._next_hash = 1
        # granted, not yet read or abandoned: one per (owner, group), as the store keeps them (the next
        # lookup of a group ends its previous lease), so this stays bounded too
        self.leases: dict[tuple[str, int], tuple[int, list[StoreKey]]] = {}
        self._baseline_table = {StoreKey(NS, "full", 0, i.to_bytes(8, "big")): i for i in range(4096)}
        self._baseline_hashes = [i.to_bytes(8, "big") for i in range(0, 8192, 64)]
        self.begin_read = getattr(store, "begin_read", None)  # the store's read API (changed over time)
        self.read_plan = getattr(store, "read_plan", None)
        if self.begin_read is None and self.read_plan is None:
            raise SystemExit("this Store has neither begin_read nor read_plan: adapt bench_store.py")

    def _hash(self) -> bytes:
        self._next_hash += 1
        return self._next_hash.to_bytes(8, "big")

    def _conversation(self) -> list[bytes]:
        return self.rng.choices(self.chains, cum_weights=self._popularity)[0]

    def _owner(self) -> str:
        return f"client{self.rng.randrange(OWNERS)}"

    # Each op prepares its arguments untimed and returns the timed call.

    def write(self) -> Callable[[], Any]:
        chain = self._conversation()
        if len(chain) >= MAX_CHAIN and not self.resident:
            chain.clear()
        new = min(self.rng.randint(1, 16), MAX_CHAIN - len(chain))
        chain.extend(self._hash() for _ in range(new))
        run = chain[-self.rng.randint(max(new, 1), min(len(chain), new + 48)):]  # the newest blocks and some held
        keys = [StoreKey(NS, leaf, s, h) for h in run for leaf in LEAVES for s in range(SHARDS)]
        sizes = [self.block] * len(keys)
        store, owner = self.store, self._owner()

        def call() -> None:
            res, statuses = store.reserve(owner, keys, sizes)
            if WRITE in statuses:
                store.commit(res.write_id, owner)
            else:
                store.abort(res.write_id)
        return call

    def _run(self) -> list[bytes]:
        """A request's run of 64-256 hashes: a prefix of its conversation, then 0-16 blocks never written."""
        chain = self._conversation()
        n = self.rng.randint(64, 256)
        held = min(len(chain), n - self.rng.randint(0, 16))
        return chain[:held] + [self._hash() for _ in range(n - held)]

    def lookup(self) -> Callable[[], Any]:
        hashes, owner, group = self._run(), self._owner(), self.rng.randrange(GROUPS)
        store, leases = self.store, self.leases

        def call() -> None:
            _masks, lease = store.lookup(NS, hashes, LEAVES, SHARDS, owner=owner, group=group)
            leases.pop((owner, group), None)  # ended by this lookup
            if lease is not None:
                leases[(owner, group)] = (lease.lease_id, list(lease.keys))
        return call

    def _take_lease(self) -> tuple[int, str, list[StoreKey]] | None:
        while self.leases:
            owner, _group = held = next(iter(self.leases))
            lease_id, keys = self.leases.pop(held)
            if lease_id in self.store.leases:  # not ended meanwhile (TTL, the owner's lease limit)
                return lease_id, owner, keys
        return None

    def read(self) -> Callable[[], Any] | None:
        taken = self._take_lease()
        if taken is None:
            return None
        lease_id, owner, keys = taken
        store, begin_read, read_plan = self.store, self.begin_read, self.read_plan

        def call() -> None:
            if begin_read is not None:
                plan = begin_read(lease_id, owner, keys)
                store.end_lease(lease_id)
                store.end_read(plan.read_id)
            else:
                read_plan(lease_id, owner, keys)  # type: ignore[misc]
                store.end_lease(lease_id)
        return call

    def abandon(self) -> Callable[[], Any] | None:
        taken = self._take_lease()
        if taken is None:
            return None
        store, lease_id = self.store, taken[0]
        return lambda: store.end_lease(lease_id)

    def touch(self) -> Callable[[], Any]:
        chain, store = list(self._conversation()), self.store
        return lambda: store.touch(NS, chain, LEAVES, SHARDS)

    def probe(self) -> Callable[[], Any]:
        hashes, store = self._run(), self.store
        return lambda: store.presence(NS, hashes, LEAVES, SHARDS)

    def expire(self) -> Callable[[], Any]:
        return self.store.expire

    def baseline(self) -> Callable[[], Any]:
        table, hashes = self._baseline_table, self._baseline_hashes

        def call() -> int:
            return sum(1 for h in hashes for leaf in LEAVES if StoreKey(NS, leaf, 0, h) in table)
        return call

    def stats(self) -> Callable[[], Any]:
        store = self.store

        def call() -> dict[str, Any]:
            return {"host": store.host_bytes(), "disk": store.disk_bytes(), "blocks": len(store.blocks),
                    "leases": len(store.leases), "reservations": len(store.reservations),
                    "counters": vars(store.counters).copy()}
        return call


def run(ops: int, window: int, warmup: int, pool: int, block: int, conversations: int, tick: float,
        lease_ttl: float, seed: int, log: Callable[[str], None], *, resident: bool = False) -> dict[str, Any]:
    arena = Arena(pool, label="bench-store")
    clock = Clock()
    store = Store(arena, clock=clock, lease_ttl=lease_ttl)
    try:
        if warmup < 0:  # default: twice the longest TTL, so that expiry runs at its steady rate when timing starts
            ttl = max(store.lease_ttl, store.reservation_ttl, getattr(store, "read_ttl", 0.0))
            warmup = max(50_000, int(2 * ttl / tick))
        work = Workload(store, block, conversations, seed, resident=resident)
        names = list(MIX)
        weights = [MIX[n] for n in names]
        for name in work.rng.choices(names, weights, k=warmup):
            clock.now += tick
            call = getattr(work, name)()
            if call is not None:
                call()
        log(f"warm-up: {warmup:,} ops, {len(store.blocks):,} blocks, {store.counters.evictions:,} evictions")
        choices = work.rng.choices(names, weights, k=ops)
        # per window, each op's timings go into flat arrays (no int object per sample: the bench's own memory
        # must not grow with the run) and are summarised when the window ends
        windows: list[dict[str, Any]] = []
        rss: list[float] = []  # the process's resident memory at each window's end
        samples = {op: array.array("q") for op in OPS}
        perf = time.perf_counter_ns
        started = time.perf_counter()
        done = 0
        for name in choices:
            clock.now += tick
            call = getattr(work, name)()
            if call is None:  # nothing to read or abandon: a lookup instead
                name, call = "lookup", work.lookup()
            t0 = perf()
            call()
            samples[name].append(perf() - t0)
            done += 1
            if done % window == 0:
                rss.append(_rss_mib())
                windows.append(_summary(samples))
                samples = {op: array.array("q") for op in OPS}
                log(f"{done:>9,} ops  {time.perf_counter() - started:6.1f} s  blocks {len(store.blocks):,}  "
                    f"leases {len(store.leases):,}  evictions {store.counters.evictions:,}")
        if any(samples.values()):
            rss.append(_rss_mib())
            windows.append(_summary(samples))
        elapsed = time.perf_counter() - started
        result = {
            "scenario": "resident" if resident else "churn", "ops": ops, "window": window, "warmup": warmup,
            "pool": pool, "block": block, "conversations": conversations,
            "tick_s": tick, "lease_ttl_s": lease_ttl, "seed": seed, "wall_s": elapsed,
            "store_api": "begin_read/end_read" if work.begin_read is not None else "read_plan",
            "final": {"blocks": len(store.blocks), "leases": len(store.leases),
                      "counters": vars(store.counters).copy()},
            "windows": windows,
            "rss_mib": rss,
        }
    finally:
        store.close()
        arena.close()
    result["first_last"] = _first_last(result["windows"])
    return result


def _rss_mib() -> float:
    """Resident memory of this process (MiB): structures that grow with history show here first."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return float("nan")


def _summary(window: Mapping[str, Sequence[int]]) -> dict[str, Any]:
    out = {}
    for op, values in window.items():
        if values:
            a = np.frombuffer(values, dtype=np.int64).astype(np.float64) / 1e3
            out[op] = {"count": len(values), "p50_us": float(np.percentile(a, 50)),
                       "p99_us": float(np.percentile(a, 99)), "mean_us": float(a.mean())}
    return out


def _first_last(windows: list[dict[str, Any]]) -> dict[str, Any]:
    first, last = windows[0], windows[-1]
    table = {}
    for op in OPS:
        if op in first and op in last:
            a, b = first[op]["p50_us"], last[op]["p50_us"]
            table[op] = {"first_p50_us": a, "last_p50_us": b, "ratio": b / a if a else float("nan"),
                         "first_p99_us": first[op]["p99_us"], "last_p99_us": last[op]["p99_us"]}
    return table


def print_table(result: dict[str, Any]) -> None:
    n = len(result["windows"])
    print(f"\n{result['scenario']}: {result['conversations']} conversations, {format_size(result['pool'])} arena, {format_size(result['block'])} blocks, "
          f"{result['ops']:,} timed ops after {result['warmup']:,} untimed, in {n} windows of {result['window']:,} "
          f"({result['wall_s']:.1f} s, "
          f"API {result['store_api']})")
    print(f"{'op':<9}{'first p50 µs':>14}{'last p50 µs':>14}{'last/first':>12}{'first p99 µs':>15}{'last p99 µs':>14}")
    for op, row in result["first_last"].items():
        print(f"{op:<9}{row['first_p50_us']:>14.1f}{row['last_p50_us']:>14.1f}{row['ratio']:>12.2f}"
              f"{row['first_p99_us']:>15.1f}{row['last_p99_us']:>14.1f}")
    rss = result["rss_mib"]
    print(f"{'RSS MiB':<9}{rss[0]:>14.0f}{rss[-1]:>14.0f}{rss[-1] / rss[0]:>12.2f}   (process memory at window end)")
    print("\np50 µs per window:")
    print(f"{'window':<8}" + "".join(f"{op:>9}" for op in OPS) + f"{'RSS MiB':>9}")
    for i, w in enumerate(result["windows"]):
        print(f"{i + 1:<8}" + "".join(f"{w[op]['p50_us']:>9.1f}" if op in w else f"{'-':>9}" for op in OPS)
              + f"{rss[i]:>9.0f}")
    final = result["final"]
    counters = final["counters"]
    looked = counters["hits"] + counters["misses"]
    print(f"\nend: {final['blocks']:,} blocks, {final['leases']:,} leases, {counters['evictions']:,} evictions, "
          f"{counters['leases_expired']:,} leases expired, lookup hit rate {counters['hits'] / max(1, looked):.0%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", type=int, default=1_000_000, help="operations in all (default 1 000 000)")
    parser.add_argument("--quick", action="store_true", help="200 000 operations")
    parser.add_argument("--window", type=int, default=0, help="ops per timing window (default: a tenth of --ops)")
    parser.add_argument("--warmup", type=int, default=-1,
                        help="untimed ops first (default: twice the store's longest TTL in ticks, at least 50 000)")
    parser.add_argument("--pool", default="64MiB", help="arena size")
    parser.add_argument("--block", default="16KiB", help="block size")
    parser.add_argument("--scenario", choices=("both", "churn", "resident"), default="both")
    parser.add_argument("--conversations", type=int, default=0,
                        help="conversations (chains): default 64 for churn, as many as fit the pool for resident")
    parser.add_argument("--tick", type=float, default=0.0005, help="simulated seconds per op")
    parser.add_argument("--lease-ttl", type=float, default=10.0, help="lease TTL in simulated seconds")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    ops = 200_000 if args.quick else args.ops
    if ops < 1:
        parser.error("--ops must be positive")
    window = args.window or max(1, ops // 10)
    pool, block = parse_size(args.pool), parse_size(args.block)
    results = {}
    for scenario in ("churn", "resident") if args.scenario == "both" else (args.scenario,):
        resident = scenario == "resident"
        # resident: every conversation's whole chain, all leaves, fits in the pool with a tenth to spare
        conversations = args.conversations or (max(1, int(0.9 * pool // block) // (MAX_CHAIN * len(LEAVES) * SHARDS))
                                               if resident else 64)
        print(f"{scenario}: {conversations} conversations", file=sys.stderr, flush=True)
        results[scenario] = run(ops, window, args.warmup, pool, block, conversations, args.tick, args.lease_ttl,
                                args.seed, lambda msg: print(msg, file=sys.stderr, flush=True), resident=resident)
        print_table(results[scenario])
    if args.json:
        machine = {"python": platform.python_version(), "platform": platform.platform()}
        args.json.write_text(json.dumps({"machine": machine, "scenarios": results}, indent=2))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
