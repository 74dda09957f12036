"""``dkv explain``: the command a team runs when its hit rate is 0 % (logic in :mod:`dkv.explain`).

Reads the cluster's directory from etcd (members, each hash's entries with
their epochs, lease TTLs), routes the request as the router would, resolves a
hint as the connector would, and, given the engine's leaf ids (``--leaf``),
asks every node the directory names whether it holds each block and in which
tier (a read-only probe: nothing is pinned or stamped). ``--engine-a`` and
``--engine-b`` compare two engines' connector settings instead (no etcd).

:func:`register` adds the command to the ``dkv`` app; it imports :mod:`dkv.cli`
only when called, so ``python -m dkv.cli`` registers it on the app it runs.
"""


import asyncio
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from dkv.errors import ConfigError, DKVError
from dkv.explain import (
    Directory,
    Entry,
    Explanation,
    NodeAnswer,
    combine_leaf_tiers,
    compare_engines,
    explain_request,
)

MAX_NAMESPACES_SHOWN = 20
CONCURRENT_READS = 32  # etcd range reads in flight at once (one per hash of the request)


def read_text_arg(value: str, what: str) -> str:
    """``value`` itself, the contents of the file ``@PATH``, or stdin for ``-``. Raises ConfigError."""
    if value == "-":
        return sys.stdin.read()
    if value.startswith("@"):
        try:
            return Path(value[1:]).read_text()
        except OSError as exc:
            raise ConfigError(f"{what} file {value[1:]}: cannot read it ({exc.strerror})") from exc
    return value


def read_settings(path: Path, which: str) -> dict[str, Any]:
    """An engine's connector settings: a JSON object (see :func:`dkv.explain.compare_engines`). Raises ConfigError."""
    try:
        doc = json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{which} {path}: cannot read it ({exc.strerror})") from exc
    except ValueError as exc:
        raise ConfigError(f"{which} {path}: not JSON ({exc})") from exc
    if not isinstance(doc, dict):
        raise ConfigError(f"{which} {path}: must be a JSON object of connector settings")
    return doc


async def gather_directory(router: Any, client: Any, namespace: str, hashes: Sequence[bytes],
                           timeout: float) -> Directory:
    """Read what the directory says about ``hashes`` in ``namespace`` (every entry, with its epoch)."""
    from dkv.etcd import get_prefix

    layout = router.layout
    members = dict(router.members)

    async def entries_of(h: bytes) -> list[Entry]:
        kvs, _ = await get_prefix(client, layout.block_prefix(namespace, h), timeout=timeout)
        row = []
        for kv in kvs:
            parsed = layout.parse_block_key(kv.key.decode())
            if parsed is not None and parsed[0] == namespace:
                row.append(Entry(parsed[2], kv.value.decode(errors="replace")))
        return row

    entries: list[list[Entry]] = []
    for start in range(0, len(hashes), CONCURRENT_READS):
        entries += await asyncio.gather(*(entries_of(h) for h in hashes[start:start + CONCURRENT_READS]))
    holders = {e.node_id for row in entries for e in row if e.node_id in members}
    ttl: dict[str, int | None] = {}
    for node_id in sorted(holders):
        lease = router.lease_of.get(node_id)
        try:
            ttl[node_id] = int((await client.lease.time_to_live(lease, timeout=timeout)).TTL) if lease else None
        except Exception:  # noqa: BLE001 - the member may vanish between the two reads
            ttl[node_id] = None
    elsewhere: dict[int, list[str]] = {}
    namespaces = None
    in_namespace: dict[int, int] | None = None
    if not any(entries) and hashes:  # nothing here: is it published under another namespace?
        wanted = {h.hex(): i for i, h in enumerate(hashes)}
        kvs, _ = await get_prefix(client, layout.blocks, keys_only=True, timeout=timeout)
        seen: set[str] = set()
        here: dict[int, int] = {}
        for kv in kvs:
            parsed = layout.parse_block_key(kv.key.decode())
            if parsed is None:
                continue
            seen.add(parsed[0])
            if parsed[0] == namespace:
                here[len(parsed[1])] = here.get(len(parsed[1]), 0) + 1
            i = wanted.get(parsed[1].hex())
            if i is not None and parsed[0] != namespace and parsed[0] not in elsewhere.setdefault(i, []):
                elsewhere[i].append(parsed[0])
        elsewhere = {i: v for i, v in elsewhere.items() if v}
        namespaces = sorted(seen)[:MAX_NAMESPACES_SHOWN]
        in_namespace = here
    return Directory(members, entries, ttl, elsewhere, namespaces, in_namespace)


async def ask_nodes(directory: Directory, extra: Sequence[str], namespace: str, hashes: Sequence[bytes],
                    leaves: Sequence[str], shards: int, token: bytes | None, timeout: float) -> dict[str, NodeAnswer]:
    """Ask every live member the directory names (and ``extra`` ones) where it holds each block; never raises."""
    from dkv.client import NodeClient

    names = {e.node_id for row in directory.entries for e in row} | set(extra)
    targets = sorted(n for n in names if n in directory.members)

    async def ask(node_id: str) -> NodeAnswer:
        client = NodeClient(directory.members[node_id].address, namespace, token=token, timeout=timeout,
                            pool_size=1, retries=1)
        try:
            per_leaf = await asyncio.wait_for(client.tiers(hashes, leaves, shards), timeout * 2)
            tiers, partial = combine_leaf_tiers(per_leaf, len(hashes))
            return NodeAnswer(node_id, tiers, None, partial)
        except (DKVError, ValueError, OSError, asyncio.TimeoutError) as exc:
            return NodeAnswer(node_id, None, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
        finally:
            await client.close()

    return {a.node_id: a for a in await asyncio.gather(*(ask(n) for n in targets))}


def _show(result: Explanation, console: Any) -> None:
    from rich.table import Table

    if result.via == "hint":
        how = f"the hint names {result.source}" if result.source else "the hint is unusable"
    else:
        how = f"routed to {result.source or 'nobody'}"
    title = f"namespace {result.namespace}: {how}"
    table = Table(title=title)
    for column in ("#", "hash", "holders", "served", "why not"):
        table.add_column(column)
    for b in result.blocks:
        holders = ", ".join(
            f"{h.node_id}" + ("" if h.live else " (gone)") + (" inferred" if h.how == "inferred" else "")
            + (f" {h.tier}" if h.tier else "") for h in b.holders) or "-"
        table.add_row(str(b.index), b.hash[:16] + ("…" if len(b.hash) > 16 else ""), holders,
                      f"yes ({b.tier})" if b.served and b.tier else "yes" if b.served else "no", b.reason or "")
    console.print(table)
    if result.hint is not None:
        h = result.hint
        console.print(f"hint: usable, names {h.peer} covering {h.depth} block(s)" if h.usable else
                      f"hint: unusable ({h.reason_code}" + (f": {h.detail}" if h.detail else "") + ")")
    for note in result.notes:
        console.print(f"note: {note}")
    console.print(f"[bold]{result.verdict}[/]")


def register(app: typer.Typer) -> None:
    """Add ``dkv explain`` to ``app``."""
    from dkv.cli import (
        ClusterOption,
        JsonOption,
        LogLevelOption,
        PrefixOption,
        _console,
        _hashes,
        _with_router,
        etcd_options,
        fail,
        read_token,
        setup_logging,
    )

    @app.command()
    @etcd_options
    def explain(
        hashes: Annotated[Optional[list[str]], typer.Argument(help="The request's block hashes in hex, root first.")] = None,
        namespace: Annotated[Optional[str], typer.Option("--namespace", "--ns", help="The engine's namespace.")] = None,
        etcd: Annotated[Optional[str], typer.Option("--etcd", help="etcd endpoints URL[,URL...].", envvar="DKV_ETCD")] = None,
        cluster: ClusterOption = "default",
        etcd_prefix: PrefixOption = "/dkv",
        hint: Annotated[Optional[str], typer.Option(help="The request's dkv_cache_hint: JSON, @FILE or - (stdin).")] = None,
        leaf: Annotated[Optional[list[str]], typer.Option(help="A leaf id of the engine (repeatable): ask the nodes, "
                                                               "per block, whether they hold it and in which tier.")] = None,
        shards: Annotated[int, typer.Option(help="TP shards per block of each leaf (with --leaf).")] = 1,
        engine_a: Annotated[Optional[Path], typer.Option(help="One engine's connector settings (JSON): compare with --engine-b.")] = None,
        engine_b: Annotated[Optional[Path], typer.Option(help="The other engine's connector settings (JSON).")] = None,
        token_file: Annotated[Optional[Path], typer.Option(help="File holding the cluster token (DKV_TOKEN also works).")] = None,
        timeout: Annotated[float, typer.Option(help="Seconds to wait for etcd and for each node.")] = 5.0,
        as_json: JsonOption = False,
        log_level: LogLevelOption = "WARNING",
        etcd_settings: Any = None,
    ) -> None:
        """Why each block of a request would or would not be served: the command for a 0 % hit rate.

        Per block: who published it or a deeper block, whether they are live, the tier they hold it in (with --leaf), and why it is not served; the hint's verdict as the connector gives it; then how many blocks a request gets and from where. With --engine-a/--engine-b: which connector settings two engines differ in, and what that does.
        """
        setup_logging(log_level)
        if engine_a is not None or engine_b is not None:
            if engine_a is None or engine_b is None:
                fail("--engine-a and --engine-b go together: the two engines' connector settings")
            try:
                result = compare_engines(read_settings(engine_a, "--engine-a"), read_settings(engine_b, "--engine-b"))
            except DKVError as exc:
                fail(str(exc))
            if as_json:
                print(json.dumps(result, indent=2, sort_keys=True, default=str))
                return
            console = _console()
            for d in result["differences"]:
                console.print(f"[bold]{d['field']}[/]: {d['a']!r} vs {d['b']!r}: {d['meaning']}")
            console.print(f"[bold]{len(result['differences'])} difference(s): each one alone can keep the engines "
                          f"from sharing blocks[/]" if result["differences"] else
                          f"[bold]{result['verdict']}[/]", highlight=False)
            return
        if not etcd:
            fail("give --etcd URL (or DKV_ETCD), or --engine-a/--engine-b to compare two engines' settings")
        if not namespace:
            fail("give --namespace, the engine's namespace (its DKVConnector's .namespace; DKV_NAMESPACE sets it)")
        try:
            from dkv.keys import check_namespace

            check_namespace(namespace)
            wanted = _hashes(hashes or [])
            raw_hint = read_text_arg(hint, "--hint") if hint is not None else None
            if not wanted and raw_hint is None:
                raise ConfigError("give the request's block hashes (hex, root first), or --hint")
            if not wanted:
                from dkv.hints import UnusableHint, parse_hint

                try:
                    deepest = parse_hint(raw_hint or "").deepest_hash
                except UnusableHint:
                    deepest = None
                wanted = [deepest] if deepest else []
            token = read_token(token_file)
            from dkv.keys import check_leaf

            for name in leaf or []:
                check_leaf(name)
            if shards < 1 or shards > 64:
                raise ConfigError(f"--shards must be in 1..64, got {shards}")
            result = asyncio.run(_explain(etcd_settings(etcd), cluster, etcd_prefix, namespace, wanted, raw_hint,
                                          list(leaf or []), shards, token, timeout, _with_router))
        except (DKVError, ValueError) as exc:
            fail(str(exc))
        if not hashes and hint is not None:
            result.notes.append("only the hint's deepest block is known: give the request's hashes for a "
                                "per-block answer")
        if as_json:
            print(json.dumps(result.to_json(), indent=2))
            return
        _show(result, _console())


async def _explain(etcd: Any, cluster: str, prefix: str, namespace: str, hashes: list[bytes], hint: str | None,
                   leaves: list[str], shards: int, token: bytes | None, timeout: float,
                   with_router: Any) -> Explanation:
    async def run(router: Any, client: Any) -> Explanation:
        directory = await gather_directory(router, client, namespace, hashes, timeout)
        chosen = router.route(namespace, hashes)
        route = (chosen.peer.node_id if chosen.peer else None, chosen.depth)
        answers: dict[str, NodeAnswer] = {}
        if leaves:
            extra = [route[0]] if route[0] else []
            if hint is not None:  # the peer a hint names is asked too, published or not
                from dkv.hints import UnusableHint, parse_hint

                try:
                    extra.append(parse_hint(hint).peer_id)
                except UnusableHint:
                    pass
            from dkv.transport import stop_progress

            try:
                answers = await ask_nodes(directory, extra, namespace, hashes, leaves, shards, token, timeout)
            finally:
                await stop_progress()
        return explain_request(namespace, hashes, directory, route, answers, hint=hint,
                               recent=router.recently_live, asked=bool(leaves))

    result: Explanation = await with_router(etcd, cluster, prefix, run)
    return result
