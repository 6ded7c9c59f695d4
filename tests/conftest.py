"""Shared fixtures: a session-wide cache with tiny random builds of each recipe."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

SPEC_BENCH = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "spec_bench" / "question.jsonl"


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One cache for the whole session (DEJAVUU_CACHE), so tiny builds are shared."""
    d = tmp_path_factory.mktemp("dejavuu-cache")
    old = os.environ.get("DEJAVUU_CACHE")
    os.environ["DEJAVUU_CACHE"] = str(d)
    yield d
    if old is None:
        os.environ.pop("DEJAVUU_CACHE", None)
    else:
        os.environ["DEJAVUU_CACHE"] = old


_built: dict[str, Path] = {}


def build_tiny(
    recipe: str,
    cache_dir: Path,
    *,
    variants=("fp32", "int8", "int4"),
    name: str | None = None,
    primary_input: str = "input_ids",
) -> Path:
    """Build (once per session) a tiny random model of ``recipe`` into the session cache."""
    from tiny import save_tiny

    from dejavuu_build.build.config import TreeDecoderConfig
    from dejavuu_build.build.pipeline import build_tree_decoder

    name = name or f"tiny-{recipe}" + ("-embeds" if primary_input == "inputs_embeds" else "")
    if name not in _built:
        src = save_tiny(recipe, cache_dir.parent / f"src-{name}")
        cfg = TreeDecoderConfig(
            model=str(src),
            name=name,
            variants=tuple(variants),
            timing=False,
            primary_input=primary_input,
            reference_tokens=12,
        )
        _built[name] = build_tree_decoder(cfg).folder
    return _built[name]


def clone_entry(src: Path, name: str) -> Path:
    """A copy of a built entry under another cache name (for tests that damage or replace it)."""
    import shutil

    from dejavuu_build.cache import cache_root

    dst = cache_root() / name
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    return dst


@pytest.fixture(scope="session")
def tiny_llama(cache_dir) -> Path:
    return build_tiny("llama", cache_dir)
