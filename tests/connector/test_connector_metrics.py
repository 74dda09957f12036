"""The connector's Prometheus registry over a real node: loads, refusals, failures and hints show up by reason."""

from __future__ import annotations

import dataclasses
import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from connector.metrics import _PLAIN, CONNECTOR_METRICS, LABELLED_FIELDS
from connector.scheduler_side import ConnectorCounters
from connector.types import KVLoadFailed, KVLoadRefused
from dkv.hints import UNPARSEABLE
from tests.connector.conftest import PAGE_BYTES, device_blocks, two_leaves
from tests.connector.test_connector import BOUND, chain, offload_chain, wait
from tests.dkv.test_metrics import check_conventions
from tests.prometheus import Scrape, parse


def scrape_registry(registry: CollectorRegistry) -> Scrape:
    return parse(generate_latest(registry).decode())


def test_every_connector_counter_is_exported_under_a_declared_family() -> None:
    fields = {f.name for f in dataclasses.fields(ConnectorCounters)}
    assert fields == {field for field, _ in _PLAIN.values()} | LABELLED_FIELDS
    for name, (kind, _, _) in CONNECTOR_METRICS.items():
        assert (kind == "counter") == name.endswith("_total"), name


def test_a_load_a_refusal_and_an_unusable_hint_show_up_by_reason(node, connectors) -> None:
    registry = CollectorRegistry()
    blocks = device_blocks(two_leaves())
    writer = connectors(node.address, blocks=blocks)
    hashes = chain(3)
    offload_chain(writer, blocks, hashes)
    reader = connectors(node.address, blocks=device_blocks(two_leaves()), metrics_registry=registry)
    assert reader.prometheus_registry() is registry
    before = scrape_registry(registry)
    assert before.value("dkv_connector_loads_total") == 0
    assert before.value("dkv_connector_unusable_hints_total", reason=UNPARSEABLE) == 0  # known reasons exist at 0

    with pytest.raises(KVLoadRefused):
        reader.load({"full": [5]}, {"full": hashes[:1]})  # no lookup before it
    assert reader.lookup(hashes, hint=b"\xff{not json")["full"] == [True] * 3  # unusable: the co-located node
    with pytest.raises(KVLoadRefused, match="same hint"):
        reader.load({"full": [5]}, {"full": hashes[:1]})  # the lookup carried another hint
    reader.lookup(hashes)
    wait(reader.load({"full": [1, 2, 3], "swa": [4]}, {"full": hashes, "swa": hashes[2:]}))

    after = scrape_registry(registry)
    assert after.value("dkv_connector_unusable_hints_total", reason=UNPARSEABLE) == 1
    assert after.value("dkv_connector_loads_refused_total", reason="no_lookup") == 1
    assert after.value("dkv_connector_loads_refused_total", reason="hint_mismatch") == 1
    assert after.total("dkv_connector_loads_refused_total") == reader.counters.loads_refused == 2
    assert after.value("dkv_connector_loads_total") == 1
    assert after.value("dkv_connector_blocks_loaded_total") == 4
    assert after.value("dkv_connector_bytes_total", direction="load") == 4 * PAGE_BYTES
    assert after.value("dkv_connector_hits_total", source="local") == 2
    assert after.value("dkv_connector_load_duration_seconds_count", source="local") == 1
    assert after.value("dkv_connector_load_duration_seconds_bucket", source="local", le="+Inf") == 1
    assert after.value("dkv_connector_load_duration_seconds_sum", source="local") > 0
    assert after.total("dkv_connector_loads_failed_total") == 0
    assert scrape_registry(writer.prometheus_registry()).value("dkv_connector_bytes_total",
                                                               direction="offload") == 6 * PAGE_BYTES
    check_conventions(after, "dkv_connector_")
    assert set(after.types) == {name.removesuffix("_total") for name in CONNECTOR_METRICS}

    with pytest.raises(ValueError, match="Duplicated"):  # one connector per registry
        connectors(node.address, metrics_registry=registry)
    reader.shutdown()
    assert not scrape_registry(registry).types, "a stopped connector is taken out of the engine's registry"


def test_a_load_from_a_node_that_stopped_answering_fails_counted_as_timeout(node_factory, connectors) -> None:
    node = node_factory()
    blocks = device_blocks(two_leaves())
    writer = connectors(node.address, blocks=blocks)
    hashes = chain(2)
    offload_chain(writer, blocks, hashes)
    reader = connectors(node.address, blocks=device_blocks(two_leaves()), timeout=1.0, local=False,
                        lookup_payload_bytes=0)  # reads ask the node (the lookup brings no bytes)
    reader.lookup(hashes)
    node.pause()
    try:
        transfer = reader.load({"full": [1, 2]}, {"full": hashes})
        started = time.monotonic()
        with pytest.raises(KVLoadFailed):
            wait(transfer, bound=BOUND)
        assert time.monotonic() - started < BOUND
    finally:
        node.kill()
    scraped = scrape_registry(reader.prometheus_registry())
    assert scraped.value("dkv_connector_loads_failed_total", reason="timeout") == 1
    assert scraped.total("dkv_connector_loads_failed_total") == reader.counters.loads_failed == 1
    assert scraped.value("dkv_connector_load_duration_seconds_count", source="local") == 0
