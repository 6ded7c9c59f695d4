"""`bench --contexts N --anatomy`: a decode step's nodes and kernel time by op type, from onnxruntime's profiler."""

from __future__ import annotations

import csv
import json

import pytest
from tiny import optimized_nodes

from dejavuu_build.bench import BenchConfig, BenchError
from dejavuu_build.bench.anatomy import ANATOMY_FILES, TOTAL, read_profile

ROWS = [
    {"question_id": 1, "category": "qa", "turns": ["What is the capital of France? Tell me about it."]},
    {"question_id": 2, "category": "qa", "turns": ["Name three rivers of Europe and where they flow."]},
]


def _event(name, ts, dur, cat="Session", op=None):
    e = {"cat": cat, "name": name, "ts": ts, "dur": dur}
    if op:
        e["args"] = {"op_name": op}
    return e


def test_read_profile_counts_the_last_runs_only(tmp_path):
    """Nodes per run and kernel ms per run from the last N model runs; earlier runs (prefill) and
    events outside any run window (session setup) are not counted."""
    ev = [_event("model_loading_uri", 0, 5)]
    ev += [_event("model_run", 100, 50), _event("a_kernel_time", 110, 30, "Node", "MatMul")]  # a prefill
    for k in range(3):
        t0 = 1000 * (k + 1)
        ev.append(_event("model_run", t0, 100))
        ev += [_event(f"m{j}_kernel_time", t0 + 10 * j, 2000, "Node", "MatMul") for j in range(2)]
        ev.append(_event("g_kernel_time", t0 + 50, 1000, "Node", "Gather"))
        ev.append(_event("g_fence_before", t0 + 51, 7, "Node", "Gather"))  # not a kernel event
    ev.append(_event("late_kernel_time", 9000, 10, "Node", "Add"))  # after every run
    path = tmp_path / "p.json"
    path.write_text(json.dumps(ev))
    ops = read_profile(path, 3)
    assert ops == {"MatMul": (2, pytest.approx(4.0)), "Gather": (1, pytest.approx(1.0))}
    with pytest.raises(ValueError, match="4 runs profiled, 5 wanted"):
        read_profile(path, 5)


def test_anatomy_needs_the_context_sweep():
    with pytest.raises(BenchError, match="--anatomy is part of the context sweep"):
        BenchConfig(model="x", anatomy=True)


def test_anatomy_profiles_every_node_of_our_step(tiny_llama, tmp_path):
    """Ours alone: the profiled step runs exactly the nodes of onnxruntime's optimised graph, op by
    op; kernel times are positive and shares add to 1; the table and files say so."""
    from dejavuu_build.bench.sweep import run_sweep
    from dejavuu_build.runtime import load

    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    sweep = run_sweep(
        BenchConfig(
            model=str(tiny_llama), max_new_tokens=6, threads=1, contexts=(16, 24), anatomy=True, data=str(data)
        ),
        tmp_path / "sweep",
    )
    a = sweep.anatomy
    assert a is not None and a.context == 16  # the first context
    ours = {r.op: r for r in a.rows if r.system == "baseline"}
    path = load(str(tiny_llama)).path
    want = optimized_nodes(path, tmp_path)
    assert {op: r.nodes_per_step for op, r in ours.items() if op != TOTAL} == dict(want)
    assert ours[TOTAL].nodes_per_step == sum(want.values())
    assert all(r.kernel_ms_per_step > 0 for r in ours.values())
    assert sum(r.share for op, r in ours.items() if op != TOTAL) == pytest.approx(1.0)
    assert a.ratio() == (None, None)  # no genai: no ratio
    for k, name in ANATOMY_FILES.items():
        assert (tmp_path / "sweep" / name).is_file() and sweep.files[f"anatomy_{k}"] == tmp_path / "sweep" / name
    rows = list(csv.DictReader((tmp_path / "sweep" / ANATOMY_FILES["csv"]).open()))
    assert {r["op"] for r in rows} == set(ours) and all(r["system"] == "baseline" for r in rows)
    meta = json.loads((tmp_path / "sweep" / ANATOMY_FILES["json"]).read_text())
    assert meta["context"] == 16 and meta["threads"] == 1 and meta["nodes_ratio"] is None
    assert "MatMul" in sweep.table() and "one decode step at context 16" in sweep.table()
