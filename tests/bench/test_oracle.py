"""The copy oracle (bench.oracle), each method's share of it, and the 'slower than baseline' flag."""

from __future__ import annotations

import csv
import json

import pytest

from dejavuu_build.bench.oracle import PROBE_TOKENS, RowProbe, measure_row_costs, plan, relative_costs, runs
from dejavuu_build.bench.report import aggregate, write_outputs
from dejavuu_build.runtime.drafters import DraftBudget, Feedback
from dejavuu_build.runtime.model import load


def test_runs_are_the_longest_upcoming_run_found_in_the_context():
    prompt = [1, 2, 3, 4, 5]
    answer = [9, 1, 2, 3, 7, 9, 1, 8]
    r = runs(prompt, answer)
    assert r[0] == 0  # the prefill's token: no step
    assert r[1] == 3  # 1 2 3 is in the prompt; 1 2 3 7 is not
    assert r[2] == 2 and r[3] == 1
    assert r[4] == 0  # 7 was never seen
    assert r[5] == 2  # 9 1 (the answer's own start), then 8 is new
    assert r[-1] == 0  # the last token is a bonus token: nothing left to draft
    assert runs(prompt, answer, max_draft=1)[1] == 1


def test_plan_drafts_a_run_only_where_its_rows_pay():
    r = [0, 3, 2, 1, 0]  # 4 tokens to decode after the prefill's
    cheap = {1: 1.0, 2: 1.2, 3: 1.5, 4: 1.8}
    assert plan(r, cheap) == (1, pytest.approx(1.8))  # one step drafts the whole run
    dear = {1: 1.0, 2: 2.5, 3: 4.0, 4: 5.0}
    assert plan(r, dear) == (4, pytest.approx(4.0))  # plain steps are cheaper
    assert plan([0], cheap) == (0, 0.0)
    assert relative_costs({1: 0.01, 2: 0.012, 3: 0.011}) == {1: 1.0, 2: pytest.approx(1.2), 3: pytest.approx(1.2)}


class StepModel:
    """The engine's loop as the probe sees it: each step's draft capped by the request's remaining
    tokens (depth <= remaining - 1), no draft accepted, a step of R rows taking ``R`` ms."""

    fill = True

    def generate(self, messages, settings):
        d, new = settings.method, 1
        d.feedback(Feedback(committed=[7], drafted=0, accepted=0))  # prefill's token: no verify time
        while new < settings.max_new_tokens:
            remaining = settings.max_new_tokens - new
            draft = d.propose([7], DraftBudget(8, min(settings.max_depth, remaining - 1), 1, False))
            rows = len(draft) + 1
            d.feedback(Feedback(committed=[7], drafted=len(draft), accepted=0, verify_seconds=rows / 1e3, rows=rows))
            new += 1


def test_row_costs_price_steps_of_exactly_r_rows():
    """A request's last steps draft fewer tokens than asked (its budget caps them): a step of R rows
    is priced on steps of R rows alone, not on every step's mean (which put 8 rows at about 6's cost)."""
    costs = measure_row_costs(StepModel(), "hi", rows=8, rounds=2)
    assert costs == {r: pytest.approx(r / 1e3) for r in range(1, 9)}
    m = StepModel()
    assert m.fill  # restored after the probe turned the engine's fill guess off


def test_row_probe_on_a_real_decoder(tiny_llama):
    """On a real (tiny) decoder: every kept step verified exactly k drafted tokens, at least the
    PROBE_TOKENS - 1 steps a request of PROBE_TOKENS + k tokens gives before its budget shrinks them,
    and the engine reported the shorter drafts of its last steps too."""
    model = load(str(tiny_llama), threads=1)
    probe = RowProbe(4)
    from dejavuu_build.runtime.settings import DecodeSettings

    model.fill = False
    model.generate("The cat sat", DecodeSettings(method=probe, max_new_tokens=PROBE_TOKENS + 4, max_depth=4))
    kept = probe.seconds()
    assert len(kept) >= PROBE_TOKENS - 1 and all(t > 0 for t in kept)
    assert len(kept) == sum(1 for d, _ in probe.steps if d == 4)
    assert any(d < 4 for d, _ in probe.steps)  # the last steps: what the old mean priced in
    assert set(measure_row_costs(model, "The cat sat", rows=3, rounds=1)) == {1, 2, 3}


def _rec(qid, method, decode_s, oracle_runs=None, cat="qa"):
    rec = {
        "qid": qid,
        "category": cat,
        "source": cat,
        "turn": 1,
        "method": method,
        "prompt_tokens": 10,
        "tokens": 5,
        "steps": 4 if method == "baseline" else 2,
        "drafted": 0 if method == "baseline" else 4,
        "accepted": 0 if method == "baseline" else 2,
        "prefill_s": 0.02,
        "decode_s": decode_s,
        "draft_s": 0.0,
        "verify_s": decode_s,
        "kv_s": 0.0,
        "overhead_s": 0.0,
        "total_s": decode_s + 0.02,
        "stop_reason": "length",
        "match": True,
        "common_prefix": 5,
        "compared": 5,
        "first_mismatch": None,
        "gated": True,
        "ids": [],
    }
    if oracle_runs is not None:
        rec["oracle_runs"] = oracle_runs
    return rec


def test_report_gives_the_oracle_share_and_flags_auto_slower_than_baseline(tmp_path):
    runs_ = [0, 3, 2, 1, 0]
    recs = []
    for q, noise in (("1", 1.0), ("2", 1.02), ("3", 0.98)):
        recs += [
            _rec(q, "baseline", 0.04 * noise, runs_),
            _rec(q, "pld", 0.02 * noise),  # 2x
            _rec(q, "auto", 0.05 * noise),  # 0.8x, the same on every prompt: beyond noise
            _rec(q, "asd", 0.0404 * noise * (1.3 if q == "2" else 0.75 if q == "3" else 1.0)),  # ~1x, noisy
        ]
    cost = {1: 0.010, 2: 0.012, 3: 0.015, 4: 0.018, 5: 0.021}
    rep = aggregate(recs, ("baseline", "pld", "auto", "asd"), ("qa",), cost)
    pld, auto, asd = rep.row("qa", "pld"), rep.row("qa", "auto"), rep.row("qa", "asd")
    # the oracle decodes each answer's 4 tokens in one step of 4 rows: 4 / 1.8 tokens per one-row time
    assert pld.oracle_tokens_per_step == pytest.approx(4.0)
    assert pld.oracle_speedup == pytest.approx(4 / 1.8)
    assert pld.oracle_share == pytest.approx((2.0 - 1) / (4 / 1.8 - 1))
    assert auto.slower and not pld.slower and not asd.slower
    assert rep.row("qa", "baseline").slower is None
    assert [r.method for r in rep.slower()] == ["auto", "auto"]  # qa and overall
    assert "slower than baseline by more than noise: auto on qa" in rep.table()
    assert rep.row("overall", "pld").oracle_speedup == pytest.approx(4 / 1.8)

    out = tmp_path / "o"
    out.mkdir()
    write_outputs(rep, out, {"model_folder": "m", "model_variant": "int4"})
    row = next(r for r in csv.DictReader((out / "results.csv").open()) if r["method"] == "auto")
    assert row["slower"] == "True" and float(row["ttft_ms"]) == pytest.approx(20.0)
    assert {"oracle_tokens_per_step", "oracle_speedup", "oracle_share", "noise"} <= set(row)
    assert json.loads((out / "results.json").read_text())["rows"][0]["oracle_speedup"] == pytest.approx(4 / 1.8)

    # no runs recorded (a run from before the oracle) or no costs: no oracle, still the flag
    old = aggregate([{k: v for k, v in r.items() if k != "oracle_runs"} for r in recs], ("baseline", "auto"), ("qa",))
    assert old.row("qa", "auto").oracle_speedup is None and old.row("qa", "auto").slower
    assert "oracle" not in old.table()
