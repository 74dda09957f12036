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


def _module_imports(path: Path, package: str) -> set[str]:
    """The modules of ``package`` that ``path`` imports, type-checking-only imports included."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names if a.name.startswith(package + ".")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith(package + "."):
            names.add(node.module)
    return names


def test_dkv_modules_import_one_another_without_a_circle() -> None:
    graph = {f"dkv.{p.stem}": _module_imports(p, "dkv") for p in (ROOT / "dkv").glob("*.py")}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in sorted(graph.get(module, ())):
            if state.get(dep) == 1:
                raise AssertionError("import circle: " + " -> ".join(path[path.index(dep):] + [dep]))
            if dep not in state:
                visit(dep, path + [dep])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
