"""The auto build's speed trial of the next tier (build.trial): int8 is quantized, written in the
preferred candidate's layout, timed against it, and kept (gated, a default candidate) only where it
is faster in every round; else nothing of it stays and the manifest says what was measured."""

from __future__ import annotations

import pytest

from dejavuu_build import schema as S
from dejavuu_build.build import trial
from dejavuu_build.build.config import TreeDecoderConfig
from dejavuu_build.build.pipeline import build_tree_decoder


def _fake_timing(ratio: float):
    """time_interleaved whose trial variant costs ``ratio`` times the candidate's in every round."""

    def timed(sessions, **kw):
        first, name = list(sessions)
        return {
            first: {"timings_ms": {}, "round_costs_ms": [10.0, 10.5, 10.2]},
            name: {"timings_ms": {}, "round_costs_ms": [10.0 * ratio, 10.5 * ratio, 10.2 * ratio]},
        }

    return timed


def _build(cache_dir, name: str, monkeypatch, ratio: float):
    from tiny import save_tiny

    monkeypatch.setattr(trial, "time_interleaved", _fake_timing(ratio))
    src = save_tiny("llama", cache_dir.parent / f"src-{name}", seed=0)
    return build_tree_decoder(TreeDecoderConfig(model=str(src), name=name, timing=True, reference_tokens=12))


@pytest.mark.slow
def test_a_slower_trial_leaves_nothing_but_its_record(cache_dir, monkeypatch):
    r = _build(cache_dir, "trial-slow", monkeypatch, ratio=1.3)
    m = r.manifest
    assert not any(S.split_variant(v)[0] == "int8" for v in m.variants), sorted(m.variants)
    assert not any(p.name.startswith("decoder_int8") for p in r.folder.iterdir())
    assert m.quantize["variants"] == ["int4"]
    (name, rec), *rest = m.default_reason["trials"].items()
    assert not rest and name == S.variant_name("int8", S.split_variant(rec["against"])[1])
    assert rec["kept"] is False and rec["ratio"] == pytest.approx(1.3, abs=0.01)
    assert rec["against"] == m.default_reason["preferred"]
    assert any(n.startswith(f"trial of {name}") for n, _ in m.steps)
    assert S.read_manifest(r.folder).default_reason["trials"] == m.default_reason["trials"]  # written


@pytest.mark.slow
def test_a_faster_trial_is_gated_and_becomes_a_candidate(cache_dir, monkeypatch):
    r = _build(cache_dir, "trial-fast", monkeypatch, ratio=0.7)
    m = r.manifest
    (name, rec), *rest = m.default_reason["trials"].items()
    assert not rest and rec["kept"] is True
    for v in ("int8", name):  # its concat base and the trial flavour, gated like every variant
        assert m.variants[v].passed and "quality" in m.variants[v].gates, v
        assert (r.folder / m.variants[v].file).is_file() and m.variants[v].file in m.files
    assert m.variants["int8"].row_guard  # its rows measured (and guarded where needed) on this machine
    assert m.variants["int8"].length_invariant == m.variants["int4"].length_invariant  # guarded as _add guards int4
    assert name in m.default_reason["candidates"]
    assert m.quantize["variants"] == ["int4", "int8"]
