"""The public surface and the house's import rules.

* every name ``refit_verify.__all__`` exports imports, and ``import refit_verify`` stays cheap;
* module-level imports between refit-verify's modules form no circle, and the layers point down
  (digests know no wire and no vLLM; the torch.distributed path needs no ZMQ; only the plugin
  imports vLLM; the policy floor imports nothing of ours above it).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import refit_verify

SRC = Path(refit_verify.__file__).resolve().parent


def test_every_exported_name_imports():
    for name in refit_verify.__all__:
        assert getattr(refit_verify, name) is not None, name
    assert refit_verify.__all__ == sorted(refit_verify.__all__)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        refit_verify.nope  # noqa: B018


def test_import_is_cheap_and_version_comes_from_metadata():
    code = "import sys, refit_verify; print(refit_verify.__version__); print(sorted(m for m in ('torch', 'zmq', 'triton', 'vllm') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout.split("\n")
    from importlib.metadata import version

    assert out[0] == version("refit-verify") and out[1] == "[]"


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _top_level_imports(path: Path) -> set[str]:
    """refit_verify modules imported at module level (function-local imports are deferred on purpose)."""
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    pkg = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    for node in tree.body:
        if isinstance(node, ast.If):  # `if TYPE_CHECKING:` blocks do not run
            continue
        nodes = [node] if isinstance(node, (ast.Import, ast.ImportFrom)) else []
        if isinstance(node, ast.Try):
            nodes = [n for n in node.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        for n in nodes:
            if isinstance(n, ast.Import):
                out.update(a.name for a in n.names if a.name.startswith("refit_verify"))
            elif n.level:
                base = pkg.rsplit(".", n.level - 1)[0] if n.level > 1 else pkg
                out.add(f"{base}.{n.module}" if n.module else base)
            elif n.module and n.module.startswith("refit_verify"):
                out.add(n.module)
                out.update(f"{n.module}.{a.name}" for a in n.names)
    return out


def _graph() -> dict[str, set[str]]:
    mods = {_module_name(p): p for p in SRC.rglob("*.py")}
    graph = {}
    for m, p in mods.items():
        graph[m] = {d for d in _top_level_imports(p) if d in mods and d != m}
    return graph


def test_no_import_circle():
    graph = _graph()
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                raise AssertionError("import circle: " + " -> ".join(path[path.index(d):] + [d]))
            if d not in state:
                visit(d)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


@pytest.mark.parametrize("module, forbidden", [
    ("refit_verify.digest.batch", ("refit_verify.transport", "refit_verify.wire.staged", "refit_verify.vllm_plugin")),
    ("refit_verify.digest.reference", ("refit_verify.digest.batch", "refit_verify.transport")),
    ("refit_verify.errors", ("refit_verify.config", "refit_verify.report", "refit_verify.digest.batch")),
    ("refit_verify.config", ("refit_verify.report", "refit_verify.digest.batch", "refit_verify.transport")),
    ("refit_verify.collective.broadcast", ("refit_verify.transport",)),
    ("refit_verify.boundary.worker", ("refit_verify.transport", "refit_verify.vllm_plugin", "refit_verify.engine.state")),
])
def test_layers_point_down(module, forbidden):
    graph = _graph()
    seen, todo = set(), [module]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        todo.extend(graph.get(m, ()))
    bad = sorted(m for m in seen for f in forbidden if m == f or m.startswith(f + "."))
    assert bad == [], f"{module} reaches {bad}"


def test_only_the_plugin_imports_vllm():
    offenders = []
    for p in SRC.rglob("*.py"):
        if "vllm_plugin" in p.parts:
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            offenders += [f"{p.relative_to(SRC)}: {n}" for n in names if n == "vllm" or n.startswith("vllm.")]
    assert offenders == []
