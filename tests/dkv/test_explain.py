"""``dkv explain``: why each block would or would not be served.

The first tests prove the pure logic (:mod:`dkv.explain`) on hand-made
directories; the rest run the command as a subprocess (``python -m dkv.cli
explain --json``) against a real etcd and real ``dkv serve`` processes that
publish what they hold, and check the reason the command gives.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

from dkv.etcd import Layout, MemberRecord, make_client
from dkv.explain import (
    AFTER_MISS,
    EVICTED,
    HINT_UNUSABLE,
    HOLDER_GONE,
    HOLDER_UNREACHABLE,
    NAMESPACE_DIFFERS,
    NOT_PUBLISHED,
    Directory,
    Entry,
    NodeAnswer,
    combine_leaf_tiers,
    compare_engines,
    explain_request,
)
from dkv.hints import build_hint
from tests.conftest import etcd_lease, wait_for_stats
from tests.dkv.test_cluster_cli import NS, _router, _until, _write

CLI_TIMEOUT = 60


def _member(node_id: str, epoch: str = "e1", every: int = 1) -> MemberRecord:
    return MemberRecord(node_id, f"10.0.0.{len(node_id)}:7420", epoch, 1, 0.0, "h", publish_every=every)


def _chain(n: int) -> list[bytes]:
    return [bytes([i + 1]) * 8 for i in range(n)]


# ---- the pure logic -----------------------------------------------------------------------------


def test_sparse_publication_infers_holders_of_unpublished_blocks_and_serves_the_prefix() -> None:
    hashes = _chain(5)
    a = _member("a", every=2)
    # a published every 2nd block of its run of 4 plus its last: blocks 1 and 3; nobody has block 4
    entries = [[], [Entry("a", "e1")], [], [Entry("a", "e1")], []]
    result = explain_request(NS, hashes, Directory({"a": a}, entries), ("a", 4))
    assert [b.served for b in result.blocks] == [True] * 4 + [False]
    assert [h.how for h in result.blocks[0].holders] == ["inferred"]
    assert [h.how for h in result.blocks[1].holders] == ["published"]
    assert (result.served, result.source, result.first_miss, result.reason_code) == (4, "a", 4, NOT_PUBLISHED)
    assert "no live peer published" in result.reason and "nodes were not asked" in result.notes[0]
    assert result.verdict.startswith("4 of 5 blocks would be served from a")


def test_the_nodes_answer_decides_tier_and_eviction_and_the_prefix_stops_at_the_first_miss() -> None:
    hashes = _chain(4)
    a = _member("a")
    entries = [[Entry("a", "e1")] for _ in hashes]
    answer = NodeAnswer("a", ["host", "disk", "absent", "host"])
    result = explain_request(NS, hashes, Directory({"a": a}, entries), ("a", 4), {"a": answer}, asked=True)
    assert [b.tier for b in result.blocks] == ["host", "disk", "absent", "host"]
    assert [b.reason_code for b in result.blocks] == [None, None, EVICTED, AFTER_MISS]
    assert result.tiers == {"host": 1, "disk": 1} and result.served == 2
    assert "evicted since publication" in result.reason


def test_partial_blocks_name_the_leaves_that_lack_them() -> None:
    tiers, partial = combine_leaf_tiers({"k": ["host", "host"], "v": ["disk", None]}, 2)
    assert tiers == ["disk", "absent"] and partial == {1: ["v"]}
    hashes = _chain(2)
    result = explain_request(NS, hashes, Directory({"a": _member("a")}, [[Entry("a", "e1")]] * 2), ("a", 2),
                             {"a": NodeAnswer("a", tiers, None, partial)}, asked=True)
    assert result.blocks[1].reason_code == EVICTED and "not for v" in result.blocks[1].reason


def test_gone_unreachable_and_foreign_namespace_reasons() -> None:
    hashes = _chain(1)
    gone = explain_request(NS, hashes, Directory({}, [[Entry("ghost", "e0")]]), (None, 0))
    assert gone.reason_code == HOLDER_GONE and "ghost" in gone.reason
    assert gone.blocks[0].holders[0].live is False
    down = explain_request(NS, hashes, Directory({"a": _member("a")}, [[Entry("a", "e1")]], {"a": 7}), ("a", 1),
                           {"a": NodeAnswer("a", None, "OpTimeout: no answer")}, asked=True)
    assert down.reason_code == HOLDER_UNREACHABLE and "in 7 s" in down.reason
    foreign = explain_request(NS, hashes, Directory({}, [[]], elsewhere={0: ["other/ns"]}, namespaces=["other/ns"]),
                              (None, 0))
    assert foreign.reason_code == NAMESPACE_DIFFERS and "other/ns" in foreign.reason
    assert any("namespaces in the directory: other/ns" in n for n in foreign.notes)
    other_hashes = explain_request(NS, hashes, Directory({}, [[]], namespaces=[NS], in_namespace={32: 5}), (None, 0))
    assert any("different hash algorithms" in n for n in other_hashes.notes)
    other_seed = explain_request(NS, hashes, Directory({}, [[]], namespaces=[NS], in_namespace={8: 5}), (None, 0))
    assert any("hash seed or algorithm" in n for n in other_seed.notes)
    restarted = explain_request(NS, hashes, Directory({"a": _member("a", "e2")}, [[Entry("a", "e1")]]), ("a", 1))
    assert restarted.blocks[0].holders[0].stale_epoch == "e1" and any("earlier epoch" in n for n in restarted.notes)


def test_a_hint_is_judged_by_the_connectors_own_resolution() -> None:
    hashes = _chain(3)
    a = _member("a")
    directory = Directory({"a": a}, [[Entry("a", "e1")]] * 3)
    usable = explain_request(NS, hashes, directory, (None, 0), hint=build_hint(a, NS, hashes, 2))
    assert usable.hint.usable and usable.hint.depth == 2 and usable.via == "hint" and usable.served == 2
    cases = {
        "{not json": "unparseable",
        build_hint(_member("nobody"), NS, hashes, 2): "unknown_peer",
        build_hint(_member("a", "e0"), NS, hashes, 2): "stale_epoch",
        build_hint(a, "other/ns", hashes, 2): "wrong_namespace",
        build_hint(a, NS, _chain(9)[5:], 2): "mismatch",
    }
    for raw, reason in cases.items():
        result = explain_request(NS, hashes, directory, ("a", 3), hint=raw)
        assert (result.hint.usable, result.hint.reason_code) == (False, reason), raw
        assert result.served == 0 and result.reason_code == HINT_UNUSABLE and reason in result.reason
        assert result.route == {"peer": "a", "depth": 3} and any("router would send" in n for n in result.notes)
    minimal = explain_request(NS, hashes, directory, (None, 0),
                              hint=json.dumps({"version": 2, "instances": [{"instance_name": "a"}]}))
    assert minimal.hint.usable and minimal.served == 3  # the directory says how deep a names-only hint goes


def test_engine_settings_that_differ_name_the_field_and_what_it_does() -> None:
    base = {"DKV_NAMESPACE": "team/abc", "kv_hash_algo": "sha256", "kv_hash_seed": 0, "leaves": {"L": 1}}
    seed = compare_engines(base, {**base, "kv_hash_seed": 7})
    assert [d["field"] for d in seed["differences"]] == ["hash_seed"] and not seed["share"]
    assert "different block hashes" in seed["verdict"]
    assert compare_engines(base, dict(base))["share"]
    layout = {"model": "m", "dtype": "bf16", "page_size": 16, "num_layers": 2, "num_kv_heads": 2, "head_dim": 64,
              "hash_algorithm": "sha256"}
    derived = compare_engines({"layout": layout}, {"layout": {**layout, "dtype": "fp8"}})
    assert [d["field"] for d in derived["differences"]] == ["namespace", "dtype"]
    assert compare_engines({"tenant": "a"}, {"DKV_TENANT": "b"})["differences"][0]["field"] == "tenant"


# ---- the command, against etcd and real nodes ----------------------------------------------------


def _explain(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dkv.cli", "explain", *args], capture_output=True, text=True,
                          timeout=CLI_TIMEOUT, stdin=subprocess.DEVNULL)


async def _explain_json(*args: str) -> dict:
    result = await asyncio.to_thread(_explain, *args, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


async def test_explain_serves_held_blocks_with_holder_and_tier_and_names_what_is_missing(
        etcd, node_factory, clients) -> None:
    a = node_factory(*etcd.node_args("exp-a"))
    hashes = [os.urandom(32) for _ in range(4)]
    await _write(clients(a.address), hashes[:3])
    async with _router(etcd.url, etcd.prefix) as router:
        await _until(router, lambda r: r.entries == 3, "three entries")
        out = await _explain_json("--namespace", NS, *etcd.cli_args(), "--leaf", "L", *(h.hex() for h in hashes))
        assert out["served"] == 3 and out["source"] == "exp-a" and out["source_address"] == a.address
        for block in out["blocks"][:3]:
            assert block["served"] and block["tier"] == "host"
            assert [(h["node_id"], h["address"], h["live"], h["how"], h["tier"]) for h in block["holders"]] == [
                ("exp-a", a.address, True, "published", "host")]
        last = out["blocks"][3]
        assert not last["served"] and last["reason_code"] == NOT_PUBLISHED and last["holders"] == []
        assert out["verdict"].startswith(f"3 of 4 blocks would be served from exp-a ({a.address}) [3 host]")

        # the text form carries the same verdict
        text = await asyncio.to_thread(_explain, "--namespace", NS, *etcd.cli_args(), *(h.hex() for h in hashes))
        assert text.returncode == 0, text.stderr
        assert "3 of 4 blocks would be served from exp-a" in " ".join(text.stdout.split())

        # a usable hint (as the router makes it) and unusable ones, judged as the connector would
        good = build_hint(router.members["exp-a"], NS, hashes, 3)
        out = await _explain_json("--namespace", NS, *etcd.cli_args(), "--hint", good, *(h.hex() for h in hashes))
        assert out["hint"]["usable"] and out["hint"]["peer"] == "exp-a" and out["served"] == 3
        for raw, reason in (("{not json", "unparseable"),
                            (build_hint(MemberRecord("nobody", "127.0.0.1:1", "e", 1, 0.0, "h"), NS, hashes, 3),
                             "unknown_peer"),
                            (build_hint(router.members["exp-a"], "other/ns", hashes, 3), "wrong_namespace")):
            out = await _explain_json("--namespace", NS, *etcd.cli_args(), "--hint", raw, *(h.hex() for h in hashes))
            assert (out["hint"]["usable"], out["hint"]["reason_code"]) == (False, reason)
            assert out["served"] == 0 and out["reason_code"] == HINT_UNUSABLE

    # the same hashes asked about in another namespace: published there, not here
    out = await _explain_json("--namespace", "team/wrong", *etcd.cli_args(), hashes[0].hex())
    assert out["blocks"][0]["reason_code"] == NAMESPACE_DIFFERS and NS in out["blocks"][0]["reason"]
    # hashes nobody offloaded, in a namespace that holds others: the hashes themselves differ
    out = await _explain_json("--namespace", NS, *etcd.cli_args(), os.urandom(32).hex())
    assert out["reason_code"] == NOT_PUBLISHED and any("hash seed or algorithm" in n for n in out["notes"])


async def test_explain_says_evicted_when_the_node_lacks_a_published_block_and_gone_when_its_publisher_is(
        etcd, node_factory, clients) -> None:
    a = node_factory(*etcd.node_args("exp-e"))
    hashes = [os.urandom(32) for _ in range(3)]
    await _write(clients(a.address), hashes[:1])
    layout = Layout(prefix=etcd.prefix)
    client = make_client(etcd.url)
    await client.connect()
    try:
        async with etcd_lease(client) as lease:
            # an entry that outlived its block (the node's delete not applied yet) and one of a node that left
            await client.kv.put(layout.block_key(NS, hashes[1], "exp-e"), a.ready["epoch"], lease=lease, timeout=5)
            await client.kv.put(layout.block_key(NS, hashes[2], "ghost"), "old", lease=lease, timeout=5)
            out = await _explain_json("--namespace", NS, *etcd.cli_args(), "--leaf", "L", hashes[1].hex())
            block = out["blocks"][0]
            assert block["reason_code"] == EVICTED and "no longer holds it" in block["reason"]
            assert block["holders"][0]["tier"] == "absent"
            out = await _explain_json("--namespace", NS, *etcd.cli_args(), "--leaf", "L", *(h.hex() for h in hashes))
            assert [b["reason_code"] for b in out["blocks"]] == [None, EVICTED, AFTER_MISS]
            out = await _explain_json("--namespace", NS, *etcd.cli_args(), hashes[2].hex())
            assert out["reason_code"] == HOLDER_GONE and out["blocks"][0]["holders"][0]["live"] is False
    finally:
        await client.close()


async def test_explain_says_a_dead_holder_does_not_answer_while_its_lease_lasts(etcd, node_factory, clients) -> None:
    dead = node_factory(*etcd.node_args("exp-dead", ttl=30))
    hashes = [os.urandom(32)]
    await _write(clients(dead.address), hashes)
    async with _router(etcd.url, etcd.prefix) as router:
        await _until(router, lambda r: r.entries == 1, "the entry")
    dead.kill()  # SIGKILL: its member key and entries stay until its 30 s lease runs out
    out = await _explain_json("--namespace", NS, *etcd.cli_args(), "--leaf", "L", "--timeout", "2", hashes[0].hex())
    assert out["served"] == 0 and out["reason_code"] == HOLDER_UNREACHABLE, out
    assert "exp-dead did not answer" in out["reason"]
    # leave etcd as the fixture wants it: the dead node's lease (and its keys) go with a revoke
    client = make_client(etcd.url)
    await client.connect()
    try:
        lease = router.lease_of["exp-dead"]
        await client.lease.revoke(lease, timeout=5)
    finally:
        await client.close()


def test_explain_compares_two_engines_settings(tmp_path: Path) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"DKV_NAMESPACE": "team/x", "kv_hash_algo": "sha256", "kv_hash_seed": 0}))
    b.write_text(json.dumps({"DKV_NAMESPACE": "team/x", "kv_hash_algo": "sha256", "kv_hash_seed": 42}))
    result = _explain("--engine-a", str(a), "--engine-b", str(b), "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert [(d["field"], d["a"], d["b"]) for d in out["differences"]] == [("hash_seed", 0, 42)]
    text = _explain("--engine-a", str(a), "--engine-b", str(b))
    assert text.returncode == 0 and "hash_seed" in text.stdout
    bad = _explain("--engine-a", str(a))
    assert bad.returncode == 2 and "go together" in bad.stderr and "Traceback" not in bad.stderr
    b.write_text("{nope")
    bad = _explain("--engine-a", str(a), "--engine-b", str(b))
    assert bad.returncode == 2 and "not JSON" in bad.stderr and "Traceback" not in bad.stderr


async def test_explain_says_disk_for_blocks_the_node_spilled(etcd, node_factory, clients, tmp_path: Path) -> None:
    spill = tmp_path / "spill"
    spill.mkdir()
    node = node_factory(*etcd.node_args("exp-disk"), "--disk", str(spill), "--disk-size", "1MiB", pool="64KiB")
    writer = clients(node.address)
    first = [os.urandom(32) for _ in range(8)]
    await _write(writer, first)
    for _ in range(2):  # 16 more blocks of 4 KiB through a 64 KiB pool: the first run leaves the host pool
        await _write(writer, [os.urandom(32) for _ in range(8)])
    stats = await wait_for_stats(node.address, lambda s: s["staging"]["blocks"] == 0 and s["blocks_on_disk"] >= 8)
    assert stats["blocks_on_disk"] >= 8, stats
    out = await _explain_json("--namespace", NS, *etcd.cli_args(), "--leaf", "L", *(h.hex() for h in first))
    assert out["served"] == 8 and out["source"] == "exp-disk", out["verdict"]
    assert out["tiers"].get("disk", 0) >= 1 and {b["tier"] for b in out["blocks"]} <= {"host", "disk"}


def test_hint_text_comes_inline_from_a_file_or_from_stdin(tmp_path: Path, monkeypatch) -> None:
    import io

    import pytest

    from dkv.cli_explain import read_text_arg
    from dkv.errors import ConfigError

    (tmp_path / "hint.json").write_text('{"a": 1}')
    assert read_text_arg('{"a": 1}', "--hint") == read_text_arg(f"@{tmp_path / 'hint.json'}", "--hint") == '{"a": 1}'
    monkeypatch.setattr("sys.stdin", io.StringIO("from stdin"))
    assert read_text_arg("-", "--hint") == "from stdin"
    with pytest.raises(ConfigError, match="cannot read"):
        read_text_arg(f"@{tmp_path / 'missing'}", "--hint")
