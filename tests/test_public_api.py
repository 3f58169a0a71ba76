"""The public surface and the house's import rules.

* every name ``refit_verify.__all__`` exports imports, and ``import refit_verify`` stays cheap;
* imports between refit-verify's modules (function-level and type-only counted) form no circle and
  no chain longer than ten modules, and every part imports only the parts its row of
  :data:`MAY_IMPORT` names (digests know no wire and no vLLM; the torch.distributed path needs no ZMQ;
  the boundary knows no transport and no engine; only the plugin imports vLLM).
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


MODULES = {_module_name(p): p for p in SRC.rglob("*.py")}

LAZY_OK = {
    "refit_verify.digest.backends": "its optional backends (numba, Triton), imported when a device type is first used",
    "refit_verify.vllm_plugin.patches": "the modules it patches, imported when vLLM imports theirs",
    "refit_verify.vllm_plugin": "register(): the patch registry, imported when vLLM loads the plugin",
}
"""Modules whose function-level imports are deliberate and not counted (each with its reason)."""


def _imports(path: Path) -> set[str]:
    """refit_verify modules ``path`` imports: module level, function level and ``TYPE_CHECKING`` alike.

    ``from pkg import name`` counts ``pkg.name`` when that is a module, else ``pkg``. Not counted: the
    function-level imports of :data:`LAZY_OK`'s modules, and the face's ``if TYPE_CHECKING:`` block
    (names for type checkers; its names are imported lazily by ``__getattr__``)."""
    name = _module_name(path)
    tree = ast.parse(path.read_text())
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tops = tree.body
    if name == "refit_verify":
        tops = [n for n in tops if not isinstance(n, ast.If)]
    nodes = [x for top in tops for x in ast.walk(top)
             if name not in LAZY_OK or not isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef))]
    out: set[str] = set()
    for n in nodes:
        if isinstance(n, ast.Import):
            out.update(a.name for a in n.names if a.name.startswith("refit_verify"))
        elif isinstance(n, ast.ImportFrom):
            mod = (pkg.rsplit(".", n.level - 1)[0] if n.level > 1 else pkg) + (f".{n.module}" if n.module else "") if n.level else n.module or ""
            if not mod.startswith("refit_verify"):
                continue
            subs = {f"{mod}.{a.name}" for a in n.names} & MODULES.keys()
            out |= subs
            if len(subs) < len(n.names):
                out.add(mod)
    return out


def _graph() -> dict[str, set[str]]:
    graph = {}
    for m, p in MODULES.items():
        deps = set()
        for d in _imports(p):
            while d and d not in MODULES:  # refit_verify.x.Name -> refit_verify.x
                d = d.rpartition(".")[0]
            if d and d != m:
                deps.add(d)
        graph[m] = deps
    return graph


def test_no_import_circle_counting_every_import():
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


def test_longest_import_chain_is_at_most_ten_modules():
    graph = _graph()
    memo: dict[str, list[str]] = {}

    def chain(m: str) -> list[str]:
        if m not in memo:
            memo[m] = [m] + max((chain(d) for d in graph[m]), key=len, default=[])
        return memo[m]

    longest = max((chain(m) for m in graph), key=len)
    assert len(longest) <= 10, " -> ".join(longest)


FOUNDATION = {"errors", "report", "verdicts", "manifest", "config", "compare"}

# part -> the parts of ours it may import (a part: a top-level module or package of refit_verify)
MAY_IMPORT = {
    "report": set(),
    "verdicts": set(),
    "_lazy": set(),
    "_moved": set(),
    "errors": {"report"},
    "manifest": {"errors"},
    "config": {"errors", "report"},
    "compare": {"errors", "report", "manifest"},
    "testing": set(),
    "digest": {"errors", "config", "_lazy"},
    "wire": {"errors", "manifest", "_lazy"},
    "stream": {"digest", "wire"} | FOUNDATION,
    "transport": {"stream", "wire", "digest", "_lazy"} | FOUNDATION,
    "collective": {"stream", "wire", "digest", "_lazy"} | FOUNDATION,
    "boundary": {"digest", "_lazy"} | FOUNDATION,
    "engine": {"boundary", "digest"} | FOUNDATION,
    "trainer": {"transport", "digest"} | FOUNDATION,
    "vllm_plugin": {"digest", "wire", "stream", "transport", "collective", "boundary", "engine", "trainer", "testing", "_lazy"} | FOUNDATION,
    "cli": {"digest", "wire", "stream", "transport", "collective", "boundary", "engine", "trainer", "vllm_plugin", "testing", "_lazy"} | FOUNDATION,
    "<face>": {"_moved", "digest"},
}


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "<face>"


@pytest.mark.parametrize("part", sorted(MAY_IMPORT))
def test_layers_point_down(part):
    graph = _graph()
    bad = sorted(f"{m} -> {d}" for m, deps in graph.items() if _part(m) == part
                 for d in deps if _part(d) != part and _part(d) not in MAY_IMPORT[part])
    assert bad == []


def test_every_part_has_a_layer_rule():
    assert {_part(m) for m in MODULES} <= MAY_IMPORT.keys()


def test_no_module_imports_the_face_or_a_name_through_a_lazy_face():
    """Inside the package, names are imported from the module that defines them: an import through a
    lazy face (``from refit_verify.transport import RefitSender``) would hide the real edge from
    these rules."""
    faces = {m for m, p in MODULES.items() if p.name == "__init__.py" and "face(" in p.read_text() or m == "refit_verify"}
    offenders = []
    for m, p in MODULES.items():
        for d in _imports(p):
            if d in faces and d != m and not (m == "refit_verify" and d == "refit_verify._moved"):
                offenders.append(f"{m} imports {d}")
    assert offenders == []


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


def test_old_module_paths_alias_the_new_ones_with_a_deprecation_warning():
    """Every flat-layout path of 0.1 still imports for one release: reads and writes reach the new
    module, and the first import warns naming the new path."""
    from refit_verify import _moved

    code = ("import importlib, warnings, refit_verify, refit_verify._moved as m\n"
            "for old, new in sorted(m.MOVED.items()):\n"
            "    with warnings.catch_warnings(record=True) as seen:\n"
            "        warnings.simplefilter('always')\n"
            "        importlib.import_module(old)\n"
            "    said = [str(w.message) for w in seen if w.category is DeprecationWarning]\n"
            "    assert any(old in t and new in t for t in said), (old, said)\n"
            "warnings.simplefilter('ignore')\n"
            "import refit_verify.check as c, refit_verify.trainer.refit as r\n"
            "assert c.refit is r.refit and c.RefitCheck is r.RefitCheck\n"
            "c.SOME_TEST_VALUE = 7\n"
            "assert r.SOME_TEST_VALUE == 7\n"
            "print(len(m.MOVED))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.strip()) == len(_moved.MOVED) >= 30
    for new in _moved.MOVED.values():
        assert new in MODULES, new


def test_the_readmes_map_of_the_code_matches_the_tree():
    """README's "Where things are" names every package and foundation module of src/refit_verify, and
    nothing that is not there."""
    import re

    text = (SRC.parents[1] / "README.md").read_text()
    section = text.split("## Where things are", 1)[1].split("\n## ", 1)[0].split("Tests mirror", 1)[0]
    named = set(re.findall(r"`([a-z_]+)/`", section)) | {m[:-3] for m in re.findall(r"`([a-z_]+\.py)`", section)}
    named -= {"kernels"}  # digest/kernels/, named inside the digest entry
    parts = {p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    parts |= {p.stem for p in SRC.glob("*.py") if not p.stem.startswith("_")}
    assert named == parts


def test_no_lazy_export_shares_its_name_with_a_submodule():
    """``from pkg import name`` returns the submodule once it is imported, shadowing a lazy export of
    the same name: every face's names differ from its package's module names."""
    for m, p in MODULES.items():
        if p.name != "__init__.py" or "face(" not in p.read_text():
            continue
        exports = ast.literal_eval(next(n.value for n in ast.parse(p.read_text()).body
                                        if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "_EXPORTS"))
        subs = {q.stem for q in p.parent.glob("*.py")} | {q.name for q in p.parent.iterdir() if (q / "__init__.py").exists()}
        assert set(exports) & subs == set(), m
