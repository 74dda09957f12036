"""The connector's Prometheus metrics, in a registry the engine passes in (or the connector makes on request).

:class:`ConnectorCollector` reads :class:`~connector.scheduler_side.ConnectorCounters`
when scraped (under their lock, a copy of a few dozen integers): the engine's
scheduler thread pays nothing it did not pay before (DESIGN §3.9). The one
number kept for metrics alone is each load's duration, observed on the
connector's loop thread into ``dkv_connector_load_duration_seconds{source}``.

Every family is listed in :data:`CONNECTOR_METRICS` (name -> type, labels,
meaning; the README's table and the tests use it). One connector per
registry: a second one's families would clash.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, Metric

from dkv.metrics import without_created
from dkv.hints import (
    MISMATCH,
    PEER_UNREACHABLE,
    STALE_EPOCH,
    UNAUTHENTICATED_PEER,
    UNKNOWN_PEER,
    UNKNOWN_VERSION,
    UNPARSEABLE,
    WRONG_NAMESPACE,
)

LOAD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
HINT_REASONS = (UNPARSEABLE, UNKNOWN_VERSION, UNKNOWN_PEER, STALE_EPOCH, WRONG_NAMESPACE, MISMATCH, PEER_UNREACHABLE,
                UNAUTHENTICATED_PEER)
LOAD_FAILURES = ("post", "checksum", "not_intact", "unauthenticated", "timeout", "transport", "lease_expired", "remote",
                 "other")

# Plain counters: family name -> the ConnectorCounters field it reads, and its meaning.
_PLAIN: dict[str, tuple[str, str]] = {
    "dkv_connector_lookups_total": ("lookups", "Lookups answered (start_lookup handles and lookup calls)"),
    "dkv_connector_lookup_failures_total": ("lookup_failures", "Lookups that failed: a miss"),
    "dkv_connector_lookups_skipped_total": ("lookups_skipped",
                                            "Lookups answered a miss without asking: the node failed to answer recently"),
    "dkv_connector_lookups_over_lease_budget_total": ("lookups_over_lease_budget",
                                                      "Lookups answered a miss: the node's max_leases were all held"),
    "dkv_connector_lookups_truncated_total": ("lookups_truncated", "Lookups longer than one request: the tail missed"),
    "dkv_connector_lookups_in_place_total": ("lookups_in_place",
                                             "Lookups answered without the loop thread: lookup() calls, and start_lookup "
                                             "handles read by their polls (direct channel: same-host or TCP)"),
    "dkv_connector_lookups_channels_busy_total": ("lookups_channels_busy",
                                                  "Lookups that took the loop thread because every direct channel to "
                                                  "the node held an answer not yet read (see direct_channels)"),
    "dkv_connector_blocks_reported_total": ("blocks_reported", "Blocks (hash x leaf) lookups reported present"),
    "dkv_connector_hints_behind_device_total": ("hints_behind_device",
                                                "Usable hints with nothing to add: the device held more already"),
    "dkv_connector_loads_total": ("loads", "Loads posted"),
    "dkv_connector_loads_in_place_total": ("loads_in_place",
                                           "Loads copied without the loop thread, from same-host slots or from the "
                                           "blocks a lookup's answer brought (in loads too)"),
    "dkv_connector_blocks_loaded_total": ("blocks_loaded", "Blocks (hash x leaf x shard) loads brought in"),
    "dkv_connector_checksum_failures_total": ("checksum_failures",
                                              "Loads failed by their checksums, offloads the node refused so, and lookups "
                                              "whose blocks sent with the answer failed theirs"),
    "dkv_connector_offloads_total": ("offloads", "Offloads posted"),
    "dkv_connector_blocks_offloaded_total": ("blocks_offloaded", "Blocks (hash x leaf x shard) stored by offloads"),
    "dkv_connector_offloads_failed_total": ("offloads_failed", "Offloads that failed"),
    "dkv_connector_offload_blocks_full_total": ("offload_blocks_full", "Offloaded blocks the node had no room for"),
    "dkv_connector_offloads_dropped_total": ("offloads_dropped",
                                             "Offloads dropped without asking: the node failed to answer recently"),
    "dkv_connector_touches_total": ("touches", "Touches sent"),
    "dkv_connector_touches_dropped_total": ("touches_dropped", "Touches dropped: too many already in flight"),
    "dkv_connector_resets_coalesced_total": ("resets_coalesced", "Prefix-cache resets folded into one waiting"),
    "dkv_connector_releases_dropped_total": ("releases_dropped", "Lease releases dropped from a full queue"),
    "dkv_connector_peer_clients_closed_total": ("peer_clients_closed", "Peer clients closed after going unused"),
}

CONNECTOR_METRICS: dict[str, tuple[str, tuple[str, ...], str]] = {
    **{name: ("counter", (), doc) for name, (_, doc) in _PLAIN.items()},
    "dkv_connector_hits_total": ("counter", ("source",),
                                 "Lookups that found at least one block, by source: local (the co-located node) "
                                 "or peer (a hinted one)"),
    "dkv_connector_unusable_hints_total": ("counter", ("reason",),
                                           "Hints that could not be used (a miss, or the co-located node), by reason"),
    "dkv_connector_loads_refused_total": ("counter", ("reason",),
                                          "Loads refused before anything moved, by reason (invalid, no_lookup, "
                                          "hint_mismatch, no_lease, lease_expired, lease_lost, not_reported)"),
    "dkv_connector_loads_failed_total": ("counter", ("reason",),
                                         "Posted loads that failed, by reason (post, checksum, timeout, transport, "
                                         "a node's error code, ...)"),
    "dkv_connector_bytes_total": ("counter", ("direction",),
                                  "Block bytes moved: load (into the device's rows), offload (stored on the node)"),
    "dkv_connector_load_duration_seconds": ("histogram", ("source",),
                                            "Time from a load's read being sent to its bytes in host buffers, "
                                            "per load that landed, by source (local, peer)"),
}
# ConnectorCounters fields read by the labelled families above (every field is exported: a test checks)
LABELLED_FIELDS = frozenset({"hits_local", "hits_peer", "unusable_hints", "loads_refused", "loads_refused_by_reason",
                             "loads_failed", "loads_failed_by_reason", "bytes_loaded", "bytes_offloaded"})


def load_duration_histogram() -> Histogram:
    """The load-duration histogram (registered nowhere: :class:`ConnectorCollector` exports it)."""
    name = "dkv_connector_load_duration_seconds"
    return Histogram(name, CONNECTOR_METRICS[name][2], ["source"], registry=None, buckets=LOAD_BUCKETS)


def _counter(name: str, labelled: dict[str, int] | None = None, value: int | None = None) -> Metric:
    _, label_names, doc = CONNECTOR_METRICS[name]
    family = CounterMetricFamily(name, doc, labels=label_names)
    if value is not None:
        family.add_metric([], value)
    for label, n in (labelled or {}).items():
        family.add_metric([label], n)
    return family


class ConnectorCollector:
    """Reads a :class:`~connector.scheduler_side.SchedulerSide`'s counters and load histogram when scraped."""

    def __init__(self, sched: Any) -> None:
        self.sched = sched

    def describe(self) -> list[Metric]:
        """The families (a second connector registered in the same registry is refused: duplicated names)."""
        return list(self.collect())

    def collect(self) -> Iterator[Metric]:
        sched = self.sched
        with sched._count_lock:  # noqa: SLF001 - the counters' own lock, held for a copy
            c = copy.copy(sched.counters)
            hints = dict(c.unusable_hints)
            refused = dict(c.loads_refused_by_reason)
            failed = dict(c.loads_failed_by_reason)
        for name, (field_name, _) in _PLAIN.items():
            yield _counter(name, value=getattr(c, field_name))
        yield _counter("dkv_connector_hits_total", {"local": c.hits_local, "peer": c.hits_peer})
        yield _counter("dkv_connector_unusable_hints_total", {**dict.fromkeys(HINT_REASONS, 0), **hints})
        from connector.scheduler_side import LOAD_REFUSALS  # here: scheduler_side imports this module

        yield _counter("dkv_connector_loads_refused_total", {**dict.fromkeys(LOAD_REFUSALS, 0), **refused})
        yield _counter("dkv_connector_loads_failed_total", {**dict.fromkeys(LOAD_FAILURES, 0), **failed})
        yield _counter("dkv_connector_bytes_total", {"load": c.bytes_loaded, "offload": c.bytes_offloaded})
        yield from without_created(sched.load_seconds.collect())
