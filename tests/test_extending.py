"""docs/extending.md stays true: every `path.py::Name` it names exists, and the registries it
describes are complete (every recipe has tiny random cases, every drafter is imported and documented,
every precision is one entry of its table, every KV layout its suffix, pass and preference, every peer
the methods the bench calls)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "extending.md"
REF = re.compile(r"`((?:dejavuu_build|tests)/[\w/]+\.py)(?:::([\w.]+))?`")


def defined(path: Path, dotted: str) -> bool:
    """``dotted`` (``Name`` or ``Class.attr``) is defined in the file: a def, class or assignment."""
    body = ast.parse(path.read_text(encoding="utf-8")).body
    for part in dotted.split("."):
        found = None
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == part:
                found = node
            elif isinstance(node, ast.Assign) and any(
                isinstance(n, ast.Name) and n.id == part for t in node.targets for n in ast.walk(t)
            ):  # `X = ...` and `A, X = ...`
                found = node
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == part:
                found = node
        if found is None:
            return False
        body = found.body if isinstance(found, ast.ClassDef) else []
    return True


def test_the_doc_names_only_what_exists():
    text = DOC.read_text(encoding="utf-8")
    refs = REF.findall(text)
    assert len(refs) > 50, "the doc's references are no longer written as `path.py::Name`"
    missing = []
    for path, name in refs:
        f = REPO / path
        if not f.is_file():
            missing.append(path)
        elif name and not defined(f, name):
            missing.append(f"{path}::{name}")
    assert not missing, f"docs/extending.md names what is not there (update the doc): {missing}"


def test_defined_tells_present_from_absent():
    base = REPO / "dejavuu_build" / "runtime" / "drafters" / "base.py"
    assert defined(base, "Drafter") and defined(base, "Drafter.wants_topk") and defined(base, "Draft.validate")
    assert not defined(base, "Drafter.no_such_thing") and not defined(base, "NoSuchClass")


# ------------------------------------------------------------------------------------------ families
def test_every_registered_recipe_has_tiny_random_cases():
    from dejavuu_build.recipes import registered
    from dejavuu_build.recipes.base import Recipe

    recipes = registered()
    files = {f.stem for f in (REPO / "dejavuu_build" / "recipes").glob("*.py")} - {"__init__", "base"}
    modules = {cls.__module__.rsplit(".", 1)[1] for cls in recipes.values()}
    assert files == modules, (
        f"a recipe module that registers nothing (not imported in recipes/__init__?): {files - modules}"
    )
    for name, cls in recipes.items():
        assert cls.name == name and cls.architectures and cls.description, name
        assert cls.tiny_config is not Recipe.tiny_config, f"{name} has no tiny_config: the family tests cannot run it"


def test_every_recipe_owns_its_tiny_configs():
    """recipe_for maps each tiny case back to its own recipe (what tests/recipes/test_families.py runs)."""
    pytest.importorskip("transformers")
    from dejavuu_build.recipes import recipe_for, registered

    for name, cls in registered().items():
        cases = cls().tiny_cases()
        assert "" in cases, name
        for case, cfg in cases.items():
            assert type(recipe_for(cfg)) is cls, (name, case)


# ------------------------------------------------------------------------------------------ drafters
def test_every_drafter_is_imported_and_documented():
    from dejavuu_build.runtime.drafters import METHODS

    declared = set()
    for f in (REPO / "dejavuu_build" / "runtime" / "drafters").glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                for d in node.decorator_list:
                    if isinstance(d, ast.Call) and getattr(d.func, "id", None) == "register" and d.args:
                        declared.add(ast.literal_eval(d.args[0]))
    assert declared, "no @register(...) found: the scan is out of date"
    assert declared | {"baseline"} == set(METHODS), f"registered but not imported: {declared - set(METHODS)}"
    table = (REPO / "docs" / "methods.md").read_text(encoding="utf-8")
    rows = set(re.findall(r"^\| `(\w+)` \|", table, re.M))
    assert set(METHODS) <= rows, f"methods with no row in docs/methods.md: {sorted(set(METHODS) - rows)}"


# ---------------------------------------------------------------------------------------- precisions
def test_every_precision_is_one_entry_of_the_table():
    """A precision is known in one place (precisions.PRECISIONS); what other modules name of it is
    a view of that table, and the tables it replaced are gone."""
    from dejavuu_build import precisions as P
    from dejavuu_build import schema as S
    from dejavuu_build.build import gates, pipeline, quality
    from dejavuu_build.quantize import nbits

    assert S.VARIANTS == P.names() and P.names()[0] == S.FP32
    assert [n for n, p in P.PRECISIONS.items() if p.reference] == [S.FP32], "fp32 is the one reference"
    for name, p in P.PRECISIONS.items():
        assert p.name == name and 0 < p.teacher_forced_floor <= 1 and 0 < p.quality_floor <= 1, name
        assert p.reference or nbits.PLANS[name] is p.plan, f"{name} has no quantization plan"
        assert P.quality_floors()[name] == p.quality_floor
    assert set(nbits.PLANS) == set(P.quantized()) and P.quantized() == tuple(P.names()[1:])
    assert P.auto_tiers() and all(not P.PRECISIONS[n].reference for t in P.auto_tiers() for n in t)
    for module, gone in ((gates, "FLOORS"), (quality, "QUALITY_FLOORS"), (pipeline, "DEFAULT_FLOORS")):
        assert not hasattr(module, gone), f"{module.__name__}.{gone} is back: read precisions.PRECISIONS"


# ---------------------------------------------------------------------------------------- KV layouts
def test_every_kv_layout_has_a_suffix_and_a_place_in_the_preference():
    """A layout is one entry of layouts.LAYOUTS: its place in the preference, its graph pass and
    step line, its batched serving graph; schema names it and gives its suffix."""
    from dejavuu_build import layouts as L
    from dejavuu_build import schema as S
    from dejavuu_build.build import pipeline

    assert set(L.LAYOUTS) == set(S.KV_LAYOUTS) == set(L.PREFERRED_LAYOUTS)
    assert sorted(lay.rank for lay in L.LAYOUTS.values()) == list(range(len(L.LAYOUTS))), "one rank each"
    for gone in ("PREFERRED_LAYOUTS", "_LAYOUT_STEPS", "static_capacity"):
        assert not hasattr(pipeline, gone), f"pipeline.{gone} is back: read layouts.LAYOUTS"
    for k, lay in L.LAYOUTS.items():
        assert lay.name == k and lay.suffix == S.LAYOUT_SUFFIXES.get(k, ""), k
        assert lay.batch in L.BATCHED_LAYOUTS, f"{k}: its batched serving graph has a pass"
        if not lay.in_place:  # the exported graph (concat): the source of the others, no suffix, no pass
            assert k not in S.LAYOUT_SUFFIXES and k not in L.DERIVED_LAYOUTS and lay.graph_pass is None
            continue
        assert k in L.DERIVED_LAYOUTS and "{p}" in lay.step and "{c}" in lay.step and lay.graph_pass, k
        assert S.split_variant(S.variant_name(S.INT4, k)) == (S.INT4, k), k
        assert defined(REPO / "dejavuu_build" / "export" / "passes" / f"{k}_kv.py", f"to_{k}_kv"), k


# --------------------------------------------------------------------------------------------- peers
def test_every_peer_has_the_peer_methods():
    """docs/extending.md's "add a peer": a module with require() and load_peers(ctx), one KINDS
    line; every peer class it returns answers the Peer protocol under the kind's method names."""
    import importlib
    import inspect

    from dejavuu_build.bench import config, genai, llamacpp, ngram
    from dejavuu_build.bench.peer import KINDS, PEER_METHODS, PLAIN_OF

    assert set(config.PEERS) == set(KINDS) == {"genai", "genai-int8", "llamacpp"}
    classes = {
        cls.name: cls for cls in (genai.GenaiPeer, ngram.GenaiNgram, llamacpp.LlamaCppPeer, llamacpp.LlamaCppLookup)
    }
    classes["genai-int8"] = genai.GenaiPeer  # the same class on genai's int8 build, named by load_peers
    assert set(PEER_METHODS) == set(classes)
    for kind in KINDS.values():
        mod = importlib.import_module(kind.module, "dejavuu_build.bench")
        assert callable(mod.require) and callable(mod.load_peers), kind.name
        assert set(dict(kind.params)) <= set(inspect.signature(mod.load_peers).parameters) - {"ctx"}, kind.name
        assert all(PLAIN_OF[m] == kind.methods[0] for m in kind.methods[1:])
    for name, cls in classes.items():
        for method in ("generate", "quality", "describe"):
            assert callable(getattr(cls, method, None)), (name, method)
