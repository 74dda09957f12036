"""A node's Prometheus metrics: its own numbers, read when scraped, plus request-duration histograms.

:class:`NodeCollector` turns what the node already counts (``NodeServer``'s
ops, errors, traffic and connections, the store's :class:`~dkv.store.StoreCounters`,
the cluster presence's membership and publisher) into metric families at
scrape time: nothing is counted twice, and nothing is paid between scrapes.
The one number counted for metrics alone is each request's duration, observed
into ``dkv_node_request_duration_seconds{op}`` by :func:`node_registry`
(one ``perf_counter`` pair and one histogram observe per request; see the
README's Metrics for what it costs).

Names follow Prometheus conventions: ``dkv_node_`` prefix, base units in the
name (``_bytes``, ``_seconds``, ``_blocks``), counters end in ``_total``.
:data:`NODE_METRICS` lists every family with its type and labels (the README's
table is made from it, and a test checks a real scrape against it).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from dkv.wire import PROTOCOL_VERSION

# Request durations run from tens of microseconds (a probe) to seconds (a large read over a slow link).
REQUEST_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                   1.0, 2.5, 5.0, 10.0)
DISK_STATES = ("ok", "full", "missing", "failing", "off")

# name -> (type, labels, meaning): every family a node exports (cluster ones only with --etcd)
NODE_METRICS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "dkv_node_info": ("gauge", ("node_id", "protocol_version"), "Always 1: the node's id and wire protocol version"),
    "dkv_node_start_time_seconds": ("gauge", (), "Unix time the node started"),
    "dkv_node_ready": ("gauge", (), "1 when /readyz answers 200 (listener up; with etcd, registered), else 0"),
    "dkv_node_requests_total": ("counter", ("op",), "Valid requests received, by wire op"),
    "dkv_node_request_duration_seconds": ("histogram", ("op",),
                                          "Time from a valid request to its reply (and payloads) sent, by op"),
    "dkv_node_errors_total": ("counter", ("code",),
                              "Error replies and refusals, by code (busy, auth, lease_expired, protocol, ...)"),
    "dkv_node_lookups_total": ("counter", (), "Lookups (leased or not)"),
    "dkv_node_lookups_with_payload_total": ("counter", (), "Leased lookups answered with their blocks' bytes "
                                            "(their loads need no read)"),
    "dkv_node_blocks_hit_total": ("counter", ("tier",),
                                  "Blocks (hash x leaf x shard) lookups found, by the tier they came from"),
    "dkv_node_blocks_missed_total": ("counter", (), "Blocks (hash x leaf x shard) lookups did not find"),
    "dkv_node_bytes_total": ("counter", ("direction", "path"),
                             "Block bytes moved: in = committed writes, out = reads and same-host loads; "
                             "path listener = over the node's connection, local = copied by a same-host client"),
    "dkv_node_blocks_committed_total": ("counter", (), "Blocks committed by writes"),
    "dkv_node_blocks_aborted_total": ("counter", (), "Reserved blocks given back uncommitted (abort, expiry, close)"),
    "dkv_node_checksum_rejects_total": ("counter", (), "Written blocks not committed: bytes did not match the checksum"),
    "dkv_node_write_refusals_total": ("counter", ("reason",),
                                      "Keys answered full: no room (full) or a credential's quota (quota)"),
    "dkv_node_leases_total": ("counter", ("event",),
                              "Lease events: granted, expired (TTL), dropped (ended for a newer one at a "
                              "client's limit or a credential's quota), refused (node at max_leases)"),
    "dkv_node_leases_held": ("gauge", (), "Leases held now"),
    "dkv_node_pinned_blocks": ("gauge", (), "Blocks pinned now by leases or reads"),
    "dkv_node_reads_in_flight": ("gauge", (), "Reads in flight now"),
    "dkv_node_reads_total": ("counter", ("event",), "Read events: refused (lease gone), expired (read TTL)"),
    "dkv_node_reservations": ("gauge", (), "Write reservations open now"),
    "dkv_node_blocks": ("gauge", ("tier",), "Blocks indexed now: host (in the pool), disk (staged or on disk)"),
    "dkv_node_evictions_total": ("counter", ("tier",),
                                 "Blocks evicted: host (out of the pool, spilled or dropped), "
                                 "disk (dropped from the disk tier for room)"),
    "dkv_node_quota_evictions_total": ("counter", (), "Blocks a credential lost to its own newer ones at its quota"),
    "dkv_node_spills_total": ("counter", ("outcome",),
                              "Evicted blocks: written (spilled to disk), failed (write error), "
                              "dropped (no staging or disk room), degraded (dropped, tier memory-only)"),
    "dkv_node_disk_errors_total": ("counter", (), "Disk reads or writes that failed"),
    "dkv_node_pool_bytes": ("gauge", ("state",), "Host pool: used, total"),
    "dkv_node_disk_bytes": ("gauge", ("state",), "Disk tier: used, total (0 without a tier)"),
    "dkv_node_disk_state": ("gauge", ("state",), "1 for the disk tier's state (ok, full, missing, failing, off)"),
    "dkv_node_staging_bytes": ("gauge", (), "Evicted blocks' bytes held in memory waiting for their spill"),
    "dkv_node_connections": ("gauge", ("state",), "Connections now: authenticated, authenticating"),
    "dkv_node_clients": ("gauge", (), "Distinct clients connected now"),
    "dkv_node_connections_reaped_total": ("counter", ("reason",),
                                          "Connections the node closed: idle (idle timeout), cap (to admit another)"),
    "dkv_node_registered": ("gauge", (), "1 while the node's etcd membership lease is live (cluster only)"),
    "dkv_node_registrations_total": ("counter", (), "Registrations in etcd (the first and every re-registration)"),
    "dkv_node_etcd_lease_losses_total": ("counter", (), "Times the node's etcd lease was lost"),
    "dkv_node_directory_entries": ("gauge", (), "Directory entries (namespace, hash) the node announces"),
    "dkv_node_publish_queue_blocks": ("gauge", (), "Directory changes waiting to be written to etcd"),
    "dkv_node_publish_dropped_total": ("counter", (), "Directory changes dropped: the queue was full (etcd outage)"),
    "dkv_node_publish_txns_total": ("counter", (), "etcd transactions the publisher wrote"),
    "dkv_node_publish_failures_total": ("counter", (), "Publisher flushes that failed (retried)"),
    "dkv_node_directory_resyncs_total": ("counter", (), "Times the publisher rewrote its entries after a lease change"),
}


def _family(name: str, value: float | None = None, labels: Iterable[tuple[Iterable[str], float]] = ()) -> Metric:
    """A counter or gauge family of ``name`` (as :data:`NODE_METRICS` declares it), with one value or labelled ones."""
    kind, label_names, doc = NODE_METRICS[name]
    if kind == "counter":
        family: Metric = CounterMetricFamily(name[: -len("_total")], doc, labels=label_names)
    else:
        family = GaugeMetricFamily(name, doc, labels=label_names)
    if value is not None:
        family.add_metric([], value)
    for label_values, v in labels:
        family.add_metric(list(label_values), v)
    return family


def without_created(metrics: Iterable[Metric]) -> Iterator[Metric]:
    """``metrics`` without their ``_created`` samples (exported as extra gauge families in the text format)."""
    for metric in metrics:
        metric.samples = [s for s in metric.samples if not s.name.endswith("_created")]
        yield metric


class NodeCollector:
    """Reads a :class:`~dkv.server.NodeServer`'s numbers at scrape time (on its event loop).

    ``timer`` (when given) adds its request-duration histogram.
    """

    def __init__(self, server: Any, timer: RequestTimer | None = None) -> None:
        self.server = server
        self.timer = timer

    def describe(self) -> list[Metric]:
        return []  # families vary (cluster ones only with etcd); nothing to check for duplicates

    def collect(self) -> Iterator[Metric]:
        server, store = self.server, self.server.store
        c = store.counters
        f = _family
        yield f("dkv_node_info", labels=[((server.node_id, str(PROTOCOL_VERSION)), 1)])
        yield f("dkv_node_start_time_seconds", server.started_at)
        yield f("dkv_node_ready", float(server.not_ready() is None))
        yield f("dkv_node_requests_total", labels=[((op,), n) for op, n in sorted(server.ops.items())])
        yield f("dkv_node_errors_total", labels=[((code,), n) for code, n in sorted(server.errors_by_code.items())])
        yield f("dkv_node_lookups_total", c.lookups)
        yield f("dkv_node_lookups_with_payload_total", server.lookup_payloads)
        yield f("dkv_node_blocks_hit_total", labels=[(("host",), c.blocks_hit_host), (("disk",), c.blocks_hit_disk)])
        yield f("dkv_node_blocks_missed_total", c.blocks_missed)
        yield f("dkv_node_bytes_total", labels=[((direction, path), n) for direction, paths in server.traffic.items()
                                                for path, n in paths.items()])
        yield f("dkv_node_blocks_committed_total", c.commits)
        yield f("dkv_node_blocks_aborted_total", c.aborted_writes)
        yield f("dkv_node_checksum_rejects_total", c.checksum_rejects)
        yield f("dkv_node_write_refusals_total", labels=[(("full",), c.full_refusals), (("quota",), c.quota_refusals)])
        yield f("dkv_node_leases_total", labels=[
            (("granted",), c.leases_granted), (("expired",), c.leases_expired),
            (("dropped",), c.leases_dropped_over_limit + c.leases_dropped_over_quota),
            (("refused",), c.leases_refused)])
        yield f("dkv_node_leases_held", len(store.leases))
        yield f("dkv_node_pinned_blocks", store.pinned_blocks)
        yield f("dkv_node_reads_in_flight", len(store.reads))
        yield f("dkv_node_reads_total", labels=[(("refused",), c.reads_refused), (("expired",), c.reads_expired)])
        yield f("dkv_node_reservations", len(store.reservations))
        off_host = store.blocks_off_host()
        yield f("dkv_node_blocks", labels=[(("host",), len(store.blocks) - off_host), (("disk",), off_host)])
        yield f("dkv_node_evictions_total", labels=[(("host",), c.evictions), (("disk",), c.disk_drops)])
        yield f("dkv_node_quota_evictions_total", c.quota_evictions)
        yield f("dkv_node_spills_total", labels=[
            (("written",), c.spills), (("failed",), c.disk_spill_failed), (("dropped",), c.spill_drops),
            (("degraded",), c.disk_degraded_drops)])
        yield f("dkv_node_disk_errors_total", c.disk_errors)
        host_free, host_total = store.host_bytes()
        disk_free, disk_total = store.disk_bytes()
        yield f("dkv_node_pool_bytes", labels=[(("used",), host_total - host_free), (("total",), host_total)])
        yield f("dkv_node_disk_bytes", labels=[(("used",), disk_total - disk_free), (("total",), disk_total)])
        disk_state = store.disk_state()
        yield f("dkv_node_disk_state", labels=[((state,), float(state == disk_state)) for state in DISK_STATES])
        yield f("dkv_node_staging_bytes", store.staging_usage()[1])
        authenticating = len(server._authenticating)  # noqa: SLF001 - the node's own bookkeeping, read only
        yield f("dkv_node_connections", labels=[(("authenticated",), server._connections() - authenticating),  # noqa: SLF001
                                                (("authenticating",), authenticating)])
        yield f("dkv_node_clients", len(server._client_conns))  # noqa: SLF001
        yield f("dkv_node_connections_reaped_total", labels=[((why,), server.reaped.get(why, 0)) for why in ("idle", "cap")])
        presence = server.presence
        if presence is not None:
            membership, publisher = presence.membership, presence.publisher
            pc = publisher.counters
            yield f("dkv_node_registered", float(membership.lease_id is not None))
            yield f("dkv_node_registrations_total", membership.registrations)
            yield f("dkv_node_etcd_lease_losses_total", membership.lease_losses)
            yield f("dkv_node_directory_entries", publisher.announced)
            yield f("dkv_node_publish_queue_blocks", publisher.pending)
            yield f("dkv_node_publish_dropped_total", pc.dropped)
            yield f("dkv_node_publish_txns_total", pc.txns)
            yield f("dkv_node_publish_failures_total", pc.flush_failures)
            yield f("dkv_node_directory_resyncs_total", pc.resyncs)
        if self.timer is not None:
            yield from without_created(self.timer.histogram.collect())


class RequestTimer:
    """``dkv_node_request_duration_seconds{op}``: the node calls it with (op, seconds) after each request.

    Each op's labelled child is made once and kept, so an observation is a
    dict lookup and one :meth:`Histogram.observe`.
    """

    def __init__(self) -> None:
        name = "dkv_node_request_duration_seconds"
        self.histogram = Histogram(name, NODE_METRICS[name][2], ["op"], registry=None, buckets=REQUEST_BUCKETS)
        self._children: dict[str, Any] = {}

    def __call__(self, op: str, seconds: float) -> None:
        child = self._children.get(op)
        if child is None:  # ops are the wire's, validated before this is reached: a small, fixed set
            child = self._children[op] = self.histogram.labels(op)
        child.observe(seconds)


def node_registry(server: Any) -> CollectorRegistry:
    """A registry holding ``server``'s metrics; from now on the server times its requests into it."""
    timer = RequestTimer()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(NodeCollector(server, timer))
    server.observe_request = timer
    return registry

