"""The dependency arrows of DESIGN.md §2: ``dkv`` imports nothing of ours; only transport imports ucxx."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_dkv_never_imports_connector_or_cluster() -> None:
    for path in (ROOT / "dkv").rglob("*.py"):
        assert not _imports(path) & {"connector", "cluster"}, f"{path.name} imports outside dkv"


# test helpers that play a misbehaving UCX peer, which only raw ucxx can do
UCXX_TEST_PEERS = {"tests/dkv/stalled_handshake.py"}


def test_only_the_transport_module_imports_ucxx() -> None:
    users = {p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.py")
             if ".venv" not in p.parts and "scripts" not in p.parts and "ucxx" in _imports(p)}
    assert users - UCXX_TEST_PEERS == {"dkv/transport.py"}
