"""One demo engine in its own process, as in serving: the reference engine, over a dKV connector or none.

``python -m cluster.demo_engine`` speaks JSON lines, one object a line:

* ``{"settings": {"model": {ModelConfig fields}, "block_size", "num_pages", "prefix_caching": bool,
  "dkv": null | {"namespace", "node", "node_id", "etcd", "cluster"}}}`` (the token, if any, comes from
  ``DKV_TOKEN``): a fresh engine and connector, the previous one drained and shut down first, so that
  nothing carries over from one configuration to the next; answered ``{"ready": true, "pid"}``.
  The first line must be one.
* one request a line ``{"id", "prompt": [token, ...], "new_tokens", "hint": str | null}``, served in
  arrival order, one at a time (the engine's scheduler is one thread); each answered by a result
  (:func:`serve_one`), or ``{"id", "error"}`` when the request itself was bad.
* EOF on stdin: the in-flight offloads are drained, the connector is shut down, exit 0.

Between requests the engine keeps polling its in-flight offloads, as a serving loop does. Times are
``time.monotonic()``, one clock for every process on the machine, so the orchestrator can subtract its
arrival times from the engine's first-token times. The process dies with its parent.

Outcome of a request's hint (``hint``): ``none`` (no hint), ``used`` (the peer served blocks),
``behind_device`` (the peer held no more than the device already had), ``no_gain`` (usable, nothing
loaded), or ``unusable:<reason>`` (the connector's reason, the co-located node asked instead).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections import Counter
from typing import Any

import torch

from cluster.process import FdLines, die_with_parent
from connector.engine.engine import Engine
from connector.engine.model import ModelConfig

IDLE_POLL = 0.002  # seconds between polls of in-flight offloads while no request waits
MAX_LINE = 1 << 24  # a request line longer than this is refused (a prompt of ~1 M tokens)


def build_engine(settings: dict[str, Any]) -> Engine:
    """The engine (and its connector, when ``settings["dkv"]`` names one) the settings ask for."""
    model = settings["model"]
    config = ModelConfig(**{**model, "window_layers": tuple(model.get("window_layers", ()))})
    engine = Engine(config, block_size=int(settings["block_size"]), num_pages=int(settings["num_pages"]))
    dkv = settings.get("dkv")
    if dkv:
        from connector.dkv_connector import DKVConnector

        token = os.environ.get("DKV_TOKEN")
        conn = DKVConnector(engine.leaf_specs, engine.device_blocks, namespace=dkv["namespace"], node=dkv["node"],
                            node_id=dkv["node_id"], etcd=dkv["etcd"], cluster=dkv.get("cluster", "default"),
                            token=token.encode() if token else None)
        engine.attach_connector(conn)
    return engine


def _counters(engine: Engine) -> tuple[int, int, int, Counter[str], int, int]:
    c = getattr(engine.connector, "counters", None)
    if c is None:
        return 0, 0, 0, Counter(), 0, 0
    return c.hits_peer, c.hits_local, c.hints_behind_device, Counter(c.unusable_hints), c.loads_refused, c.loads_failed


def serve_one(engine: Engine, request: dict[str, Any], prefix_caching: bool) -> dict[str, Any]:
    """Run one request; the result names where each prompt block came from and when the first token was ready.

    ``source`` is ``peer`` or ``local`` for the blocks the connector loaded (one source a request),
    ``logits_sha256`` digests the float32 logits the tokens were chosen from (bit-exactness is compared
    on it by the orchestrator).
    """
    if not prefix_caching:
        engine.reset_device_cache()  # the reference configuration keeps nothing between requests
    hint = request.get("hint")
    before = _counters(engine)
    started = time.monotonic()
    result = engine.generate(request["prompt"], int(request["new_tokens"]), hint=hint.encode() if hint else None)
    after = _counters(engine)
    stats = result.stats
    peer = after[0] > before[0]
    unusable = after[3] - before[3]
    if hint is None:
        outcome = "none"
    elif unusable:
        outcome = "unusable:" + sorted(unusable)[0]
    elif after[2] > before[2]:
        outcome = "behind_device"
    elif peer and stats.connector_hit_blocks:
        outcome = "used"
    else:
        outcome = "no_gain"
    logits = result.logits.detach().to("cpu", torch.float32).contiguous()
    return {
        "id": request["id"],
        "tokens": result.tokens,
        "logits_sha256": hashlib.sha256(logits.numpy().tobytes()).hexdigest(),
        "started": started,
        "first_token": started + stats.prefill_seconds,
        "prompt_blocks": stats.prompt_blocks,
        "device_hit_blocks": stats.device_hit_blocks,
        "connector_hit_blocks": stats.connector_hit_blocks,
        "computed_blocks": stats.computed_blocks,
        "source": ("peer" if peer else "local") if stats.connector_hit_blocks else None,
        "loaded_bytes": stats.loaded_bytes,
        "load_seconds": stats.load_seconds,
        "prefill_seconds": stats.prefill_seconds,
        "loads_refused": after[4] - before[4],
        "loads_failed": after[5] - before[5],
        "hint": outcome,
    }


def _send(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def _close(engine: Engine | None) -> None:
    """Land the engine's offloads and shut its connector down."""
    if engine is None:
        return
    engine.drain(30)
    shutdown = getattr(engine.connector, "shutdown", None)
    if shutdown is not None:
        shutdown()


def main() -> int:
    die_with_parent()
    torch.set_num_threads(1)  # engines share the machine's cores with the nodes and UCX
    lines = FdLines(sys.stdin.fileno(), MAX_LINE)
    engine: Engine | None = None
    prefix_caching = True
    try:
        while True:
            line = lines.next(IDLE_POLL if engine is not None and engine.pending_offloads else 1.0)
            if line is None:
                if engine is not None:
                    engine.poll()
                continue
            if not line.strip():
                if lines.eof:
                    break
                continue
            message = json.loads(line)
            if "settings" in message:  # a fresh engine (a new configuration): nothing carries over
                _close(engine)
                engine = None
                engine = build_engine(message["settings"])
                prefix_caching = bool(message["settings"].get("prefix_caching", True))
                _send({"ready": True, "pid": os.getpid()})
                continue
            if engine is None:
                _send({"id": message.get("id"), "error": "no settings yet: the first line must carry them"})
                continue
            try:
                _send(serve_one(engine, message, prefix_caching))
            except ValueError as exc:  # a bad request (token outside the vocabulary, too long): said, not fatal
                _send({"id": message.get("id"), "error": str(exc)})
    except KeyboardInterrupt:
        pass
    finally:
        _close(engine)
    return 0


if __name__ == "__main__":
    sys.exit(main())
