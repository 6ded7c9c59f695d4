"""The package's import graph, read from the source (ast): no import circle, no private name taken
from another module, and the build's cache key free of the code that does not shape a build.

Two graphs:
- **at import time**: the imports a module runs when it is imported (module level, class bodies,
  `try`/`if` blocks), not those inside functions nor under `if TYPE_CHECKING:`. A circle here is an
  import-order hazard; there is none, and no allow-list: none may appear.
- **by design**: every import statement, the lazy ones inside functions and the TYPE_CHECKING ones
  too. A circle here is one "broken" only by a lazy or TYPE_CHECKING import (issue 36): two modules
  that each need the other, which usually means a piece that belongs in a third. The ones that
  exist today are listed, each with the edge that closes it, in ``DESIGN_CIRCLES``; the test fails
  on a circle not listed and on a listed one that is gone (delete its entry: the list stays true).

An edge `m -> t`: `m` imports module `t` (`import t`, `from t import x`, `from pkg import t`), or a
name that package `t`'s `__init__` defines (or, for `runtime`, loads lazily: `runtime.LAZY`
maps such a name to its module). Importing `a.b.c` also runs `a.b`'s `__init__`: that is an edge
too, except to a package that contains `m` (its `__init__` is already running when `m` is
imported, so it adds no order of its own) unless `m` takes a name its `__init__` defines.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import dejavuu_build
from dejavuu_build import cache

PACKAGE = "dejavuu_build"
ROOT = Path(dejavuu_build.__file__).resolve().parent
P = PACKAGE + "."

# Circles through lazy / TYPE_CHECKING imports that exist today, each a set of modules (the
# strongly connected component) with the edge that closes it. Remove an entry when its circle goes.
DESIGN_CIRCLES: dict[frozenset[str], str] = {}

# `from <module of this package> import _private`: each use listed, (importer, module, name).
# Remove an entry when its import goes; a new one fails the test (make the name public, or move it).
PRIVATE_IMPORTS: set[tuple[str, str, str]] = set()


# ------------------------------------------------------------------------------------------ graph
def modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the package (a package is its __init__.py)."""
    out = {}
    for f in sorted(ROOT.rglob("*.py")):
        parts = [PACKAGE, *f.relative_to(ROOT).with_suffix("").parts]
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


MODULES = modules()


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def import_nodes(body: list[ast.stmt], deferred: bool):
    """The import statements of ``body`` that run at import time; with ``deferred``, every one."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if deferred:
                yield from (n for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom)))
        elif isinstance(node, ast.If) and _type_checking(node.test):
            if deferred:
                yield from import_nodes(node.body, deferred)
            yield from import_nodes(node.orelse, deferred)
        else:  # class bodies, if/try/with/for blocks: run at import time
            for field in ("body", "orelse", "finalbody", "handlers"):
                sub = getattr(node, field, None)
                if isinstance(sub, list):
                    stmts = [s.body if isinstance(s, ast.ExceptHandler) else [s] for s in sub]
                    for s in stmts:
                        yield from import_nodes(s, deferred)


def _lazy_names(package: str) -> dict[str, str]:
    """Names a package's __init__ loads on first use (PEP 562), name -> its module's dotted name."""
    lazy = getattr(importlib.import_module(package), "LAZY", None) if package == P + "runtime" else None
    return {k: f"{package}.{v}" for k, v in (lazy or {}).items()}


def source(name: str, node: ast.ImportFrom) -> str | None:
    """The module of the package a `from ... import` in module ``name`` reads from (None: another package)."""
    if node.level:
        here = name.split(".") if MODULES[name].name == "__init__.py" else name.split(".")[:-1]
        target = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
    elif node.module and node.module.split(".")[0] == PACKAGE:
        target = node.module
    else:
        return None
    assert target in MODULES, f"{name} imports {target}, which is not a module of the package"
    return target


def imported(name: str, node: ast.Import | ast.ImportFrom) -> list[tuple[str, str | None]]:
    """(module of the package, the name taken from it or None) for each thing ``node`` imports."""
    if isinstance(node, ast.Import):
        return [(a.name, None) for a in node.names if a.name in MODULES]
    if (target := source(name, node)) is None:
        return []
    out: list[tuple[str, str | None]] = []
    for a in node.names:
        if f"{target}.{a.name}" in MODULES:
            out.append((f"{target}.{a.name}", None))
        elif a.name in (lazy := _lazy_names(target)):
            out.append((lazy[a.name], a.name))
        else:
            out.append((target, a.name))
    return out


def graph(deferred: bool) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    for name, f in MODULES.items():
        for node in import_nodes(ast.parse(f.read_text(encoding="utf-8"), str(f)).body, deferred):
            for target, what in imported(name, node):
                if what is not None and name.startswith(target + "."):
                    edges[name].add(target)  # a name its own package's __init__ defines: a real need
                    continue
                parts = target.split(".")
                for i in range(2, len(parts) + 1):  # a.b.c runs a.b's __init__, then a.b.c
                    t = ".".join(parts[:i])
                    if t in MODULES and t != name and not name.startswith(t + "."):
                        edges[name].add(t)
    return edges


def circles(edges: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = set()
            while True:
                w = stack.pop()
                on.discard(w)
                scc.add(w)
                if w == v:
                    break
            if len(scc) > 1:
                out.append(frozenset(scc))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def describe(scc: frozenset[str], edges: dict[str, set[str]]) -> str:
    short = lambda m: m.removeprefix(P)  # noqa: E731
    return "{" + ", ".join(f"{short(a)} -> {short(b)}" for a in sorted(scc) for b in sorted(edges[a] & scc)) + "}"


# ------------------------------------------------------------------------------------------ tests
def test_the_graph_sees_real_imports():
    """The walker finds what Python runs: a module-level import, a lazy one, a TYPE_CHECKING one,
    a parent package's __init__ and the runtime's lazy names (else every check below is vacuous)."""
    now, later = graph(deferred=False), graph(deferred=True)
    assert P + "layouts" in now[P + "serve.batch"]  # `from ..layouts import ...`
    assert P + "layouts.base" in now[P + "layouts.static"]  # `from .base import ...`
    assert P + "runtime.drafters" in now[P + "runtime.job"]  # `from .drafters.base import ...` runs drafters/__init__
    assert P + "runtime.model" not in now[P + "serve.batch"]  # only under TYPE_CHECKING there
    assert P + "runtime.model" in later[P + "serve.batch"]
    assert P + "serve.bench" in later[P + "serve.cli"] and P + "serve.bench" not in now[P + "serve.cli"]  # lazy
    assert P + "runtime.model" in later[P + "bench.sweep"]  # `from ..runtime import load`: a lazy name
    assert P + "runtime" not in now[P + "runtime.job"]  # its own package: already running
    assert all(set(now[m]) <= set(later[m]) for m in MODULES)


def test_no_import_circle_at_import_time():
    edges = graph(deferred=False)
    found = circles(edges)
    assert not found, "import circles: " + "; ".join(describe(c, edges) for c in found)


def test_design_circles_are_the_listed_ones():
    edges = graph(deferred=True)
    found = set(circles(edges))
    new = [describe(c, edges) for c in found - set(DESIGN_CIRCLES)]
    gone = [DESIGN_CIRCLES[c] for c in set(DESIGN_CIRCLES) - found]
    assert not new, (
        "import circles closed by a lazy or TYPE_CHECKING import, not in DESIGN_CIRCLES (move the shared "
        "piece to a module both import, or list the circle with why): " + "; ".join(new)
    )
    assert not gone, f"listed circles that no longer exist (remove them from DESIGN_CIRCLES): {gone}"


def test_serve_commands_and_their_modules_do_not_import_each_other():
    """serve's cli imports bench and ray_app (lazily); they take what they share from serve.server."""
    edges = graph(deferred=True)
    for m in ("serve.bench", "serve.ray_app", "serve.server"):
        assert P + "serve.cli" not in edges[P + m], m
    assert not edges[P + "serve.server"] & {P + "serve.bench", P + "serve.ray_app"}


def test_no_private_name_imported_across_modules():
    used = set()
    for name, f in MODULES.items():
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"), str(f))):
            if isinstance(node, ast.ImportFrom):
                for target, what in imported(name, node):
                    if what and what.startswith("_") and not what.startswith("__") and target != name:
                        used.add((name, target, what))
    new, gone = used - PRIVATE_IMPORTS, PRIVATE_IMPORTS - used
    assert not new, f"private names imported from another module (make them public or move them): {sorted(new)}"
    assert not gone, f"listed private imports that no longer exist (remove them from PRIVATE_IMPORTS): {sorted(gone)}"


# ------------------------------------------------------------------ the build's cache-key closure
def _closure(base: Path) -> set[str]:
    return {f.relative_to(base).as_posix() for f in cache.import_closure(base)}


def test_cache_key_closure_covers_the_build_folder():
    """The package's `build/` folder is named like a build output that tools skip: the cache key's
    closure (read from the source, not from a file listing) must include it."""
    closure = _closure(ROOT)
    build = {f.relative_to(ROOT).as_posix() for f in (ROOT / "build").glob("*.py")}
    assert cache.BUILD_ROOT in closure
    for part in ("build/__init__.py", "build/gates.py", "build/config.py", "build/sources.py", "build/timing.py"):
        assert part in build and part in closure, part


def test_tools_do_not_skip_the_build_folder():
    """Tools that skip folders named `build` (pytest's default norecursedirs, .gitignore templates,
    structure tools) must not skip the package's: packaging, ruff, mypy, pytest and git all see it."""
    import subprocess
    import sys

    from setuptools import find_packages

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    repo = ROOT.parent
    build = sorted(f.relative_to(repo).as_posix() for f in (ROOT / "build").glob("*.py"))
    assert len(build) > 5
    assert PACKAGE + ".build" in find_packages(str(repo), include=[PACKAGE + "*"])
    shown = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--show-files", PACKAGE], cwd=repo, capture_output=True, text=True
    ).stdout
    assert all(f in shown for f in build), "ruff skips the package's build/ folder"
    cfg = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]
    assert "build" not in cfg["pytest"]["ini_options"]["norecursedirs"]  # else tests/build is never collected
    assert PACKAGE in cfg["mypy"]["files"] and "exclude" not in cfg["mypy"]
    if (repo / ".git").exists():
        ignored = subprocess.run(["git", "check-ignore", *build], cwd=repo, capture_output=True, text=True).stdout
        assert not ignored.strip(), f"git ignores: {ignored}"


def test_runtime_package_keeps_model_and_drafters_out_of_the_closure():
    """runtime/__init__ loads `load`/`Model`/`GenerationResult` on first use, the batch drivers'
    `Rows` lives with the layouts (not in runtime.job, whose drafters import runs every drafter),
    and the closure does not follow TYPE_CHECKING imports (serve.batch names runtime.model's Model
    for typing only): what the build imports (the gates drive the runtime's Decoder and the
    server's batch drivers) brings in neither runtime/model.py nor the engine nor any drafter, so
    editing a drafter keeps every cache key."""
    closure = _closure(ROOT)
    for outside in (
        "runtime/model.py",
        "runtime/model_drafter.py",
        "runtime/engine.py",
        "runtime/job.py",
        "runtime/drafters/__init__.py",
        "runtime/drafters/base.py",
        "runtime/drafters/auto.py",
        "runtime/drafters/suffix.py",
        "runtime/drafters/lookahead.py",
    ):
        assert outside not in closure, outside
    assert not any(f.startswith("runtime/drafters/") for f in closure)
    for inside in ("runtime/__init__.py", "runtime/decoder.py", "serve/batch.py", "layouts/rowwise.py"):
        assert inside in closure, inside  # still hashed: the build runs them


def test_closure_skips_type_checking_imports_only(tmp_path):
    """A TYPE_CHECKING import never runs: not hashed; its `else:` branch and a lazy import are."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from . import b\nelse:\n    from . import c\n"
        "def f():\n    from . import d\n"
    )
    for name in "bcd":
        (pkg / f"{name}.py").write_text("")
    assert {f.name for f in cache.import_closure(pkg, root="a.py")} == {"a.py", "c.py", "d.py"}


def test_closure_sees_no_lazy_runtime_name():
    """The closure cannot follow runtime/__init__'s lazy names (an attribute look-up, not an import
    statement): no module it hashes may take one of them from the package."""
    lazy = set(importlib.import_module(P + "runtime").LAZY)
    hashed = {f.resolve() for f in cache.import_closure(ROOT)}
    assert len(hashed) > 20
    for name, f in MODULES.items():
        if f.resolve() not in hashed:
            continue
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and source(name, node) == P + "runtime":
                taken = {a.name for a in node.names} & lazy
                assert not taken, (
                    f"{name} imports {sorted(taken)} from dejavuu_build.runtime: import them from runtime.model"
                )


def test_runtime_lazy_names_load():
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import dejavuu_build.runtime.session\n"
        "assert 'dejavuu_build.runtime.model' not in sys.modules\n"
        "assert not any(m.startswith('dejavuu_build.runtime.drafters') for m in sys.modules)\n"
        "from dejavuu_build.runtime import GenerationResult, Model, load\n"
        "from dejavuu_build.runtime.model import load as direct\n"
        "assert load is direct and Model.__name__ == 'Model'\n"
        "import dejavuu_build.runtime as r\n"
        "assert {'load', 'Model', 'GenerationResult'} <= set(dir(r))\n"
        "try:\n    r.not_a_name\nexcept AttributeError:\n    pass\nelse:\n    raise SystemExit('no AttributeError')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
