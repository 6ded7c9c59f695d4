"""`bench --compare genai` and `bench --contexts`: sweep prompts, the × genai math, the missing package, end to end."""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from dejavuu_build.bench import BenchConfig, BenchError
from dejavuu_build.bench import ngram as NGRAM
from dejavuu_build.bench.config import Prompt, select_next
from dejavuu_build.bench.peer import PeerResult
from dejavuu_build.bench.report import aggregate, write_outputs
from dejavuu_build.bench.runner import peer_record
from dejavuu_build.bench.sweep import SWEEP_FILES, summarize, sweep_prompt

TEXTS = [
    "The cat sat on the mat.",
    "Ünïcödé — text, with multi-byte characters: ∑ ≠ ∞.",
    "def add(a, b):\n    return a + b",
    "A" * 300,
    "Short.",
    "Translate to German: the weather is nice today, isn't it?",
]


def _cli():
    from dejavuu_build.bench.cli import bench
    from dejavuu_build.cli import main

    if "bench" not in main.commands:
        main.add_command(bench)
    return main


# ---------------------------------------------------------------------------------- sweep prompts
@pytest.mark.parametrize("n", [1, 2, 7, 64, 333, 400])
def test_sweep_prompt_has_exactly_n_ids_of_the_joined_text(n):
    from tiny import tiny_tokenizer

    tok = tiny_tokenizer()
    encode = lambda t: tok.encode(t, add_special_tokens=False)  # noqa: E731
    ids = sweep_prompt(encode, TEXTS, n)
    assert len(ids) == n
    assert ids == encode("\n\n".join(TEXTS))[:n]  # a prefix of the whole text's own tokenization


def test_sweep_prompt_refuses_too_little_text():
    encode = lambda t: list(t.encode())  # noqa: E731 - a byte tokenizer
    assert sweep_prompt(encode, ["ab", "cd"], 6) == list(b"ab\n\ncd")
    with pytest.raises(BenchError, match="too little text for a 7-token context"):
        sweep_prompt(encode, ["ab", "cd"], 7)
    with pytest.raises(BenchError):
        sweep_prompt(encode, ["ab"], 0)


def test_sweep_prompt_on_spec_bench_with_a_real_tokenizer():
    """Multi-byte BPE on Spec-Bench text: still exactly N ids (skips without the data or a SmolLM2 build)."""
    from dejavuu_build.bench.config import default_data_path, read_prompts
    from dejavuu_build.bench.sweep import sweep_texts
    from dejavuu_build.cache import cache_root

    data = default_data_path()
    folder = next(
        (
            p
            for p in (cache_root() / "smollm2-135m", Path.home() / ".cache/dejavuu/smollm2-135m")
            if (p / "tokenizer.json").is_file()
        ),
        None,
    )
    if data is None or folder is None:
        pytest.skip("needs Spec-Bench and a SmolLM2 tokenizer")
    from dejavuu_build.runtime.tokenizer import TextTokenizer

    tok = TextTokenizer(folder)
    texts = list(sweep_texts(read_prompts(data)))
    for n in (256, 1024, 4096):
        assert len(sweep_prompt(lambda t: tok.encode(t, add_special_tokens=False), texts, n)) == n


# ---------------------------------------------------------------------------------- × genai math
def _rec(qid, cat, method, tokens, decode_s, turn=1):
    return {
        "qid": qid,
        "category": cat,
        "source": cat,
        "turn": turn,
        "method": method,
        "prompt_tokens": 10,
        "tokens": tokens,
        "steps": tokens - 1,
        "drafted": 0,
        "accepted": 0,
        "prefill_s": 0.01,
        "decode_s": decode_s,
        "draft_s": 0.0,
        "verify_s": decode_s,
        "kv_s": 0.0,
        "overhead_s": 0.0,
        "total_s": decode_s + 0.01,
        "stop_reason": "length",
        "match": True,
        "common_prefix": tokens,
        "compared": tokens,
        "first_mismatch": None,
        "gated": method != "genai",
        "ids": [],
    }


def _gm(xs):
    return math.exp(sum(map(math.log, xs)) / len(xs))


def _prefix(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_x_genai_is_the_geomean_of_per_prompt_rate_ratios(tmp_path):
    # decode tokens = tokens - 1 = 100, so rate = 100 / decode_s
    recs = [
        _rec("1", "qa", "baseline", 101, 1.0),
        _rec("1", "qa", "pld", 101, 0.5),
        _rec("1", "qa", "genai", 101, 0.8),
        _rec("2", "qa", "baseline", 101, 2.0),
        _rec("2", "qa", "pld", 101, 0.4),
        _rec("2", "qa", "genai", 101, 1.0),
        # a two-turn prompt: its turns pool into one rate per method (200 tokens over the summed time)
        _rec("3", "mt_bench", "baseline", 101, 1.0),
        _rec("3", "mt_bench", "baseline", 101, 3.0, turn=2),
        _rec("3", "mt_bench", "pld", 101, 1.0),
        _rec("3", "mt_bench", "pld", 101, 1.0, turn=2),
        _rec("3", "mt_bench", "genai", 101, 1.0),
        _rec("3", "mt_bench", "genai", 101, 1.0, turn=2),
    ]
    methods = ("baseline", "pld", "genai")
    rep = aggregate(recs, methods, ("qa", "mt_bench"))
    qa_base = _gm([(100 / 1.0) / (100 / 0.8), (100 / 2.0) / (100 / 1.0)])
    qa_pld = _gm([(100 / 0.5) / (100 / 0.8), (100 / 0.4) / (100 / 1.0)])
    mt_base, mt_pld = (200 / 4.0) / (200 / 2.0), 1.0
    assert rep.row("qa", "baseline").x_peer.get("genai") == pytest.approx(qa_base)
    assert rep.row("qa", "pld").x_peer.get("genai") == pytest.approx(qa_pld)
    assert rep.row("mt_bench", "baseline").x_peer.get("genai") == pytest.approx(mt_base)
    assert rep.row("mt_bench", "pld").x_peer.get("genai") == pytest.approx(mt_pld)
    assert rep.row("overall", "baseline").x_peer.get("genai") == pytest.approx(
        _gm([qa_base, mt_base])
    )  # geo-mean of categories
    assert rep.row("overall", "pld").x_peer.get("genai") == pytest.approx(_gm([qa_pld, mt_pld]))
    assert all(rep.row(c, "genai").x_peer.get("genai") == pytest.approx(1.0) for c in ("qa", "mt_bench", "overall"))
    # the speedup over our baseline is unchanged by the peer's presence
    assert rep.row("qa", "pld").speedup == pytest.approx((3.0 / 200) / (0.9 / 200))
    assert "× genai" in rep.table()

    out = tmp_path / "o"
    out.mkdir()
    write_outputs(rep, out, {"model_folder": "m", "model_variant": "int4"})
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert "x_genai" in rows[0]
    assert float(
        next(r for r in rows if r["category"] == "overall" and r["method"] == "pld")["x_genai"]
    ) == pytest.approx(_gm([qa_pld, mt_pld]))
    assert json.loads((out / "results.json").read_text())["rows"][0]["x_genai"] == pytest.approx(qa_base)

    plain = aggregate([r for r in recs if r["method"] != "genai"], ("baseline", "pld"), ("qa", "mt_bench"))
    assert all(r.x_peer.get("genai") is None for r in plain.rows) and "× genai" not in plain.table()


def test_sweep_summary_medians_and_x_genai():
    def rec(system, rep, decode_s, forward_s, host):
        return {
            "context": 256,
            "system": system,
            "repeat": rep,
            "prompt_tokens": 256,
            "tokens": 11,
            "steps": 10,
            "prefill_s": 0.1,
            "decode_s": decode_s,
            "decode_tok_s": 10 / decode_s,
            "forward_ms_per_step": None if forward_s is None else 1e3 * forward_s / 10,
            "host_ms_per_step": host,
            "match_pct": 50.0,
            "note": "",
        }

    rows = summarize(
        [
            rec("baseline", 0, 0.2, 0.15, 5.0),
            rec("baseline", 1, 0.1, 0.08, 2.0),
            rec("baseline", 2, 0.4, 0.3, 10.0),
            rec("genai", 0, 0.1, 0.09, 1.0),
            rec("genai", 1, 0.1, 0.09, 1.0),
            rec("genai", 2, 0.1, None, None),
        ]
    )
    ours, g = rows
    assert (ours.system, g.system, ours.runs) == ("baseline", "genai", 3)
    assert ours.decode_tok_s == pytest.approx(50.0) and ours.step_ms == pytest.approx(20.0)
    assert ours.forward_ms_per_step == pytest.approx(15.0) and ours.host_ms_per_step == pytest.approx(5.0)
    assert ours.x_genai == pytest.approx(0.5) and g.x_genai == pytest.approx(1.0)
    assert g.host_ms_per_step == pytest.approx(1.0) and g.match_pct == 50.0 and ours.match_pct is None

    # a second genai build in the same sweep: its own row and column, each over its own rate
    rows8 = summarize(
        [rec("baseline", 0, 0.2, 0.15, 5.0), rec("genai", 0, 0.1, 0.09, 1.0), rec("genai-int8", 0, 0.16, 0.1, 1.0)]
    )
    ours, g, g8 = rows8
    assert g8.system == "genai-int8" and g8.match_pct == 50.0
    assert ours.x_genai == pytest.approx(0.5) and ours.x_genai_int8 == pytest.approx(0.8)
    assert g8.x_genai_int8 == pytest.approx(1.0) and g8.x_genai == pytest.approx(0.625) and g.x_genai_int8 == 1.6


def test_the_sweep_compares_with_genai_builds_only_and_each_has_its_column():
    from dataclasses import fields

    from dejavuu_build.bench.config import SWEEP_PEERS
    from dejavuu_build.bench.peer import KINDS, column
    from dejavuu_build.bench.sweep import SweepRow

    assert set(SWEEP_PEERS) == {k.name for k in KINDS.values() if k.module == ".genai"} == {"genai", "genai-int8"}
    assert {column(p) for p in SWEEP_PEERS} <= {f.name for f in fields(SweepRow)}
    assert BenchConfig(model="m", compare=("genai-int8",), contexts=(64,)).compare == ("genai-int8",)
    with pytest.raises(BenchError, match="genai and genai-int8 only .not llamacpp.: drop --contexts"):
        BenchConfig(model="m", compare=("genai", "llamacpp"), contexts=(64,))


# ---------------------------------------------------------------------------------- the missing package
def test_missing_genai_is_one_line_and_exit_2(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "onnxruntime_genai", None)  # import onnxruntime_genai -> ImportError
    for extra in ([], ["--contexts", "256"]):
        r = CliRunner().invoke(
            _cli(), ["bench", "--model", "no-such-build", "--compare", "genai", "--out", str(tmp_path / "x"), *extra]
        )
        assert r.exit_code == 2, r.output
        lines = [ln for ln in r.output.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("error:"), r.output
        assert "onnxruntime-genai" in lines[0] and ".[compare]" in lines[0]
    assert not (tmp_path / "x").exists()
    r = CliRunner().invoke(_cli(), ["bench", "--model", "m", "--compare", "vllm"])
    assert r.exit_code == 2 and "unknown --compare vllm; choose from: genai, genai-int8, llamacpp" in r.output
    with pytest.raises(BenchError, match="--compare"):
        BenchConfig(model="m", methods=("baseline", "genai"))


# ---------------------------------------------------------------------------------- end to end
ROWS = [
    {"question_id": 1, "category": "qa", "turns": ["Q: what is the cat on? The cat sat on the mat. The cat sat on"]},
    {"question_id": 81, "category": "writing", "turns": ["Write a short poem about rain.", "Now make it rhyme."]},
    # the next prompt of each category: where genai's n-gram options are chosen, never measured
    {"question_id": 2, "category": "qa", "turns": ["The dog ran in the park. The dog ran in the park. The dog"]},
    {"question_id": 82, "category": "roleplay", "turns": ["Say arr, pirate: arr arr arr arr arr.", "Again."]},
]


def test_genai_peer_built_once_timed_and_swept(tiny_llama, cache_dir, tmp_path, monkeypatch):
    pytest.importorskip("onnxruntime_genai")
    from dejavuu_build.bench import genai as G
    from dejavuu_build.bench import run_bench
    from dejavuu_build.bench.sweep import run_sweep
    from dejavuu_build.schema import read_contract, read_manifest

    manifest = read_manifest(tiny_llama)
    folder = G.ensure_genai_model(manifest)
    assert folder.parent == cache_dir / ".peers" and folder.name.startswith("genai0.")
    rec = json.loads((folder / G.PEER_FILE).read_text())
    assert rec["onnxruntime_genai"] == __import__("onnxruntime_genai").__version__ and rec["precision"] == "int4"
    assert {"model.onnx", "genai_config.json"} <= set(rec["files"])
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]  # no HF copy, builder cache or log left
    assert not [p for p in folder.parent.iterdir() if ".staging" in p.name]
    G.check_peer(folder)

    def no_rebuild(*a, **k):
        raise AssertionError("the peer was rebuilt")

    monkeypatch.setattr(G, "_run_builder", no_rebuild)
    assert G.ensure_genai_model(manifest) == folder  # a second run reuses it

    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg = BenchConfig(
        model=str(tiny_llama),
        methods=("pld",),
        categories=("qa", "mt_bench"),
        per_category=1,
        max_new_tokens=12,
        threads=1,
        data=str(data),
        compare=("genai",),
    )
    report = run_bench(cfg, tmp_path / "run")
    recs = [json.loads(line) for line in (tmp_path / "run" / "records.jsonl").read_text().splitlines()]
    peer = [r for r in recs if r["method"] == "genai"]
    assert len(peer) == 3 and not any(r["gated"] for r in peer)  # 1 + 2 turns, never gated
    assert {r["prompt_tokens"] for r in peer if r["turn"] == 1} == {
        r["prompt_tokens"] for r in recs if r["method"] == "baseline" and r["turn"] == 1
    }  # the same ids
    assert all(r["tokens"] >= 1 and r["steps"] == r["tokens"] - 1 for r in peer)
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    assert res["gate"]["passed"] and "genai" in res["peers"]
    assert res["peers"]["genai"]["onnxruntime_genai"] == rec["onnxruntime_genai"]
    for m in ("baseline", "pld", "genai", "genai-ngram"):
        assert report.row("overall", m).x_peer.get("genai") is not None
        assert report.row("overall", m).x_peer.get("genai-ngram") is not None
    assert report.row("overall", "genai").x_peer.get("genai") == pytest.approx(1.0)
    assert report.row("overall", "genai-ngram").x_peer.get("genai-ngram") == pytest.approx(1.0)
    assert "× genai" in report.table() and "× genai-ngram" in report.table()
    # genai's n-gram decoding ran for real, interleaved on the measured prompts, with genai's own stats
    ngram = [r for r in recs if r["method"] == "genai-ngram"]
    assert [(r["qid"], r["turn"]) for r in ngram] == [(r["qid"], r["turn"]) for r in peer]
    assert not any(r["gated"] for r in ngram)
    # steps = its target forwards after the first round (which may already emit every token)
    assert all(r["speculative"]["target_forward_passes"] >= max(r["steps"], 1) and r["steps"] >= 0 for r in ngram)
    # its token match is against genai plain's tokens of the same prompt and turn
    plain = {(r["qid"], r["turn"]): r["ids"] for r in peer}
    for r in ngram:
        g = plain[r["qid"], r["turn"]]
        assert r["plain_common_prefix"] == _prefix(r["ids"], g) and r["plain_match"] == (r["ids"] == g)
        assert r["plain_compared"] == max(len(r["ids"]), len(g))
    row = report.row("overall", "genai-ngram")
    assert row.match_plain_pct == pytest.approx(
        100.0 * sum(r["plain_common_prefix"] for r in ngram) / sum(r["plain_compared"] for r in ngram)
    )
    assert report.row("overall", "genai").match_plain_pct is None
    assert res["peers"]["genai-ngram"]["vs_plain"] == {
        "plain": "genai",
        "generations": 3,
        "identical": sum(r["plain_match"] for r in ngram),
        "match_pct": row.match_plain_pct,
    }
    assert "genai-ngram" in res["gate"]["not_gated"]
    # the sweep: on the next prompts of each category, every config recorded, the fastest over genai plain chosen
    sweep_rec = json.loads((tmp_path / "run" / NGRAM.SWEEP_FILE).read_text())
    assert sweep_rec["prompts"] == ["2", "82"] and not set(sweep_rec["prompts"]) & {r["qid"] for r in recs}
    assert [[r["ngram_size"], r["max_draft_tokens"]] for r in sweep_rec["results"]] == [
        list(c) for c in NGRAM.SWEEP_CONFIGS
    ]
    best = max(sweep_rec["results"], key=lambda r: r["x_genai"])
    chosen = {"ngram_size": best["ngram_size"], "max_draft_tokens": best["max_draft_tokens"]}
    assert sweep_rec["chosen"] == chosen == res["peers"]["genai-ngram"]["speculative"]
    assert res["peers"]["genai-ngram"]["chosen_by"] == "sweep"
    assert res["peers"]["genai-ngram"]["sweep"]["results"] == sweep_rec["results"]
    for r in sweep_rec["results"]:
        assert r["prompts"] == 2 and 0.0 <= r["match_pct"] <= 100.0 and r["decode_tok_s"] > 0
    csv_rows = list(csv.DictReader((tmp_path / "run" / "results.csv").open()))
    assert {"x_genai_ngram", "match_plain_pct"} <= set(csv_rows[0])
    assert {r["method"] for r in csv_rows} == {"baseline", "pld", "genai", "genai-ngram"}
    # genai's build is scored by our variant's quality gate: same texts, same positions, its own numbers
    ours_q = manifest.variants[res["model_variant"]].gates["quality"]
    peer_q = res["peers"]["genai"]["quality"]
    assert (peer_q["set_sha256"], peer_q["positions"]) == (ours_q["set_sha256"], ours_q["positions"])
    assert 0.0 <= peer_q["top1"] <= 1.0 and peer_q["mean_kl"] >= 0.0
    assert report.row("overall", "genai").top1_vs_fp32 == peer_q["top1"]
    assert report.row("overall", "pld").top1_vs_fp32 == ours_q["top1"]
    # its teacher-forced logits are genai's own: its greedy continuation is every position's argmax
    ids = [int(t) for t in np.random.default_rng(3).integers(3, read_contract(tiny_llama).vocab_size, 20)]
    gen = G.GenaiPeer(folder, 1).generate(ids, 8, ignore_eos=True)
    logits = G.GenaiReplay(folder, 1).logits(ids + gen.tokens[:-1])
    assert logits.shape[0] == len(ids) + len(gen.tokens) - 1
    assert sum(int(a == b) for a, b in zip(logits[len(ids) - 1 :].argmax(-1), gen.tokens)) >= len(gen.tokens) - 1

    sweep = run_sweep(
        BenchConfig(
            model=str(tiny_llama),
            max_new_tokens=10,
            threads=1,
            compare=("genai",),
            contexts=(16, 48),
            data=str(data),
            anatomy=True,
        ),
        tmp_path / "sweep",
    )
    # --anatomy: genai's step runs every node of its optimised graph; the ratio is ours over it
    from tiny import optimized_nodes

    a = sweep.anatomy
    theirs = {r.op: r.nodes_per_step for r in a.rows if r.system == "genai" and r.op != "total"}
    assert theirs == dict(optimized_nodes(folder / "model.onnx", tmp_path))
    nodes, ms = a.ratio()
    assert nodes == pytest.approx(a.total("baseline").nodes_per_step / a.total("genai").nodes_per_step) and ms > 0
    assert "ours / genai per step" in sweep.table()
    for c in (16, 48):
        ours, g = sweep.row(c, "baseline"), sweep.row(c, "genai")
        assert ours.prompt_tokens == g.prompt_tokens == c
        assert ours.tokens == g.tokens == 10  # EOS ignored: a fixed number of steps
        assert ours.host_ms_per_step is not None and ours.forward_ms_per_step > 0
        assert g.forward_ms_per_step > 0 and g.host_ms_per_step is not None
        assert g.x_genai == pytest.approx(1.0)
    lines = (tmp_path / "sweep" / SWEEP_FILES["records"]).read_text().splitlines()
    replays = [json.loads(x) for x in lines if json.loads(x)["system"] == "genai"]
    # the replay ran genai's own computation at genai's shapes: the same argmax at (nearly) every step
    assert all(r["replay_tokens"] == 10 and r["replay_argmax_agree"] >= 9 for r in replays)
    for k in ("csv", "json", "png"):
        assert (tmp_path / "sweep" / SWEEP_FILES[k]).is_file()


def test_genai_int8_peer_is_its_own_8_bit_build_timed_beside_int4(tiny_llama, cache_dir, tmp_path):
    """--compare genai-int8: genai's builder at -p int8 (its own folder and record, every MatMulNBits
    8-bit), plain decoding only, timed on the same ids beside the int4 peer, scored on our quality gate."""
    pytest.importorskip("onnxruntime_genai")
    import onnx

    from dejavuu_build.bench import genai as G
    from dejavuu_build.bench import run_bench
    from dejavuu_build.schema import read_manifest

    manifest = read_manifest(tiny_llama)
    f4, f8 = G.ensure_genai_model(manifest), G.ensure_genai_model(manifest, precision="int8")
    assert f4 != f8 and "-int8-cpu-" in f8.name and "-int4-cpu-" in f4.name
    rec = G.check_peer(f8)
    assert rec["precision"] == "int8" and rec["command"][rec["command"].index("-p") + 1] == "int8"
    bits = {
        next(a.i for a in n.attribute if a.name == "bits")
        for n in onnx.load(str(f8 / "model.onnx"), load_external_data=False).graph.node
        if n.op_type == "MatMulNBits"
    }
    assert bits == {8}
    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg = BenchConfig(
        model=str(tiny_llama),
        methods=("baseline",),
        categories=("qa",),
        per_category=1,
        max_new_tokens=10,
        threads=1,
        data=str(data),
        compare=("genai", "genai-int8"),
        genai_ngram="off",
    )
    assert cfg.peer_methods == ("genai", "genai-int8")
    report = run_bench(cfg, tmp_path / "run")
    recs = [json.loads(line) for line in (tmp_path / "run" / "records.jsonl").read_text().splitlines()]
    p4 = [r for r in recs if r["method"] == "genai"]
    p8 = [r for r in recs if r["method"] == "genai-int8"]
    assert len(p8) == len(p4) == 1 and p8[0]["prompt_tokens"] == p4[0]["prompt_tokens"]  # the same ids
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    assert res["peers"]["genai-int8"]["precision"] == "int8" and res["peers"]["genai"]["precision"] == "int4"
    assert res["peers"]["genai-int8"]["folder"] == str(f8)
    q8 = res["peers"]["genai-int8"]["quality"]
    assert 0.0 <= q8["top1"] <= 1.0 and q8["positions"] == res["peers"]["genai"]["quality"]["positions"]
    assert report.row("overall", "baseline").x_peer["genai-int8"] > 0
    assert report.row("overall", "genai-int8").x_peer["genai-int8"] == pytest.approx(1.0)
    assert report.row("overall", "genai-int8").top1_vs_fp32 == q8["top1"]
    assert "× genai-int8" in report.table()
    assert "x_genai_int8" in next(csv.DictReader((tmp_path / "run" / "results.csv").open()))

    # the context sweep times both builds at the same contexts; --anatomy profiles each build's graph
    from tiny import optimized_nodes

    from dejavuu_build.bench.sweep import run_sweep

    sweep = run_sweep(
        BenchConfig(
            model=str(tiny_llama),
            max_new_tokens=8,
            threads=1,
            compare=("genai", "genai-int8"),
            contexts=(16,),
            data=str(data),
            anatomy=True,
        ),
        tmp_path / "sweep",
    )
    ours, g4, g8 = sweep.row(16, "baseline"), sweep.row(16, "genai"), sweep.row(16, "genai-int8")
    assert ours.prompt_tokens == g4.prompt_tokens == g8.prompt_tokens == 16 and g8.tokens == 8
    assert ours.x_genai_int8 == pytest.approx(ours.decode_tok_s / g8.decode_tok_s)
    assert g8.x_genai_int8 == pytest.approx(1.0) and g8.forward_ms_per_step > 0 and g8.match_pct is not None
    meta = json.loads((tmp_path / "sweep" / SWEEP_FILES["json"]).read_text())
    assert meta["peers"]["genai-int8"]["precision"] == "int8" and meta["peers"]["genai"]["precision"] == "int4"
    assert "x_genai_int8" in next(csv.DictReader((tmp_path / "sweep" / SWEEP_FILES["csv"]).open()))
    a = sweep.anatomy
    theirs = {r.op: r.nodes_per_step for r in a.rows if r.system == "genai-int8" and r.op != "total"}
    assert theirs == dict(optimized_nodes(f8 / "model.onnx", tmp_path)) and theirs["MatMulNBits"] > 0
    nodes, ms = a.ratio("genai-int8")
    assert nodes == pytest.approx(a.total("baseline").nodes_per_step / a.total("genai-int8").nodes_per_step)
    assert ms > 0 and "ours / genai-int8 per step" in sweep.table() and "ours / genai per step" in sweep.table()
    assert "× genai-int8" in sweep.table()


def test_sweep_verify_rows_probe_runs_exactly_r_rows(tiny_llama, tmp_path):
    """--verify-rows: each probe step verifies R rows (R-1 drafted tokens) and the decoded text
    is still plain decoding's (the probe is a drafter like any other: lossless)."""
    from dejavuu_build.bench.sweep import VERIFY, run_sweep

    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    new = 12
    sweep = run_sweep(
        BenchConfig(
            model=str(tiny_llama), max_new_tokens=new, threads=1, contexts=(16, 40), verify_rows=(2, 5), data=str(data)
        ),
        tmp_path / "sweep",
    )
    recs = [json.loads(x) for x in (tmp_path / "sweep" / SWEEP_FILES["records"]).read_text().splitlines()]
    for c in (16, 40):
        plain = next(r for r in recs if r["context"] == c and r["system"] == "baseline")
        for n in (2, 5):
            probe = next(r for r in recs if r["context"] == c and r["system"] == VERIFY and r["rows"] == n)
            assert probe["ids"] == plain["ids"]  # lossless, as every drafter
            # every step drafts n-1 tokens but the last (at most n-1) ones, cut to what is left
            full = probe["steps"] - (n - 1)
            assert probe["drafted"] >= full * (n - 1) and probe["drafted"] <= probe["steps"] * (n - 1)
            row = sweep.row(c, VERIFY, n)
            assert row.rows == n and 1 < row.rows_mean <= n and row.x_plain_forward > 0
            assert row.x_genai is None
        assert sweep.row(c, "baseline").rows == 1 and sweep.row(c, "baseline").x_plain_forward is None
    assert "× plain fwd" in sweep.table()
    meta = json.loads((tmp_path / "sweep" / SWEEP_FILES["json"]).read_text())
    assert meta["config"]["verify_rows"] == [2, 5] and meta["verify"]
    assert (tmp_path / "sweep" / SWEEP_FILES["png"]).is_file()


def test_verify_rows_needs_contexts_and_two_rows():
    with pytest.raises(BenchError, match="--contexts"):
        BenchConfig(model="m", verify_rows=(2,))
    with pytest.raises(BenchError, match="2 or more"):
        BenchConfig(model="m", contexts=(64,), verify_rows=(1, 4))
    r = CliRunner().invoke(_cli(), ["bench", "--model", "m", "--contexts", "64", "--verify-rows", "2,x"])
    assert r.exit_code == 2 and "--verify-rows takes comma-separated whole numbers" in r.output


# ---------------------------------------------------------------------------------- genai's n-gram decoding
def test_x_genai_ngram_and_its_match_with_genai_plain(tmp_path):
    recs = [
        _rec("1", "qa", "baseline", 101, 1.0),
        _rec("1", "qa", "genai", 101, 0.8),
        _rec("1", "qa", "genai-ngram", 101, 0.5),
        _rec("2", "qa", "baseline", 101, 2.0),
        _rec("2", "qa", "genai", 101, 1.0),
        _rec("2", "qa", "genai-ngram", 101, 1.25),
    ]
    recs[2].update(plain_match=False, plain_common_prefix=40, plain_compared=101)
    recs[5].update(plain_match=True, plain_common_prefix=101, plain_compared=101)
    rep = aggregate(recs, ("baseline", "genai", "genai-ngram"), ("qa",))
    assert rep.row("qa", "baseline").x_peer.get("genai-ngram") == pytest.approx(_gm([0.5 / 1.0, 1.25 / 2.0]))
    assert rep.row("qa", "genai").x_peer.get("genai-ngram") == pytest.approx(_gm([0.5 / 0.8, 1.25 / 1.0]))
    assert rep.row("qa", "genai-ngram").x_peer.get("genai") == pytest.approx(_gm([0.8 / 0.5, 1.0 / 1.25]))
    assert rep.row("overall", "genai-ngram").match_plain_pct == pytest.approx(100.0 * 141 / 202)
    assert rep.row("qa", "genai").match_plain_pct is None
    table = rep.table()
    assert "× genai-ngram" in table and f"{100.0 * 141 / 202:.1f}%" in table
    out = tmp_path / "o"
    out.mkdir()
    write_outputs(rep, out, {"model_folder": "m", "model_variant": "int4"})
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert float(
        next(r for r in rows if r["method"] == "baseline" and r["category"] == "overall")["x_genai_ngram"]
    ) == pytest.approx(_gm([0.5, 0.625]))
    qa_ngram = json.loads((out / "results.json").read_text())["rows"][2]
    assert qa_ngram["method"] == "genai-ngram" and qa_ngram["match_plain_pct"] == pytest.approx(100.0 * 141 / 202)
    no_ngram = aggregate([r for r in recs if r["method"] != "genai-ngram"], ("baseline", "genai"), ("qa",))
    assert all(r.x_peer.get("genai-ngram") is None for r in no_ngram.rows) and "× genai-ngram" not in no_ngram.table()


def test_peer_record_matches_ngram_with_genai_plain_not_our_baseline():
    p = Prompt("7", "qa", "qa", ("x",))
    res = PeerResult(
        [1, 2, 9, 4],
        10,
        0.01,
        0.02,
        [0.003] * 3,
        forwards=2,
        speculative={"draft_tokens_evaluated": 5, "draft_tokens_accepted": 3, "target_forward_passes": 3},
    )
    rec = peer_record(p, 1, res, [1, 2, 3, 4], "genai-ngram", plain_ids=[1, 2, 9, 9, 9])
    assert (rec["method"], rec["common_prefix"], rec["match"]) == ("genai-ngram", 2, False)  # vs ours
    assert (rec["plain_common_prefix"], rec["plain_compared"], rec["plain_match"]) == (3, 5, False)
    assert (rec["steps"], rec["drafted"], rec["accepted"]) == (2, 5, 3)  # genai's forwards and counts
    assert "plain_common_prefix" not in peer_record(p, 1, res, [1, 2, 3, 4], "genai")


class _FakeGenai:
    """genai's generator reduced to what the sweep reads: a config's speed and tokens, set by the test."""

    def __init__(self, speeds: dict, tokens: dict):
        self.speeds, self.tokens, self.calls = speeds, tokens, []

    def generate(self, ids, max_new_tokens, *, ignore_eos=False, speculative=None):
        self.calls.append(speculative)
        toks = self.tokens.get(speculative, [5] * max_new_tokens)
        decode_s = (len(toks) - 1) / self.speeds[speculative]
        return PeerResult(
            list(toks),
            len(ids),
            0.01,
            0.01 + decode_s,
            [0.001] * (len(toks) - 1),
            forwards=None if speculative is None else 4,
            speculative=None if speculative is None else {"draft_tokens_evaluated": 4, "draft_tokens_accepted": 2},
        )


def test_ngram_sweep_records_every_config_and_picks_the_fastest_over_genai_plain():
    chat = type("T", (), {"template": "{{ messages }}"})()  # a chat model: the sweep sends messages
    model = type("M", (), {"encode": staticmethod(lambda msgs: [1, 2, 3]), "tokenizer": chat})()
    configs = ((2, 4), (3, 8), (4, 16))
    speeds = {None: 100.0, (2, 4): 90.0, (3, 8): 150.0, (4, 16): 120.0}
    genai = _FakeGenai(speeds, {(3, 8): [5, 5, 7, 7, 7, 7, 7, 7]})
    prompts = [Prompt("a", "qa", "qa", ("x",)), Prompt("b", "rag", "rag", ("y", "z"))]
    rec = NGRAM.run_ngram_sweep(model, genai, prompts, 8, configs)
    assert genai.calls == [None, (2, 4), (3, 8), (4, 16), None, (3, 8), (4, 16), (2, 4)]  # plain first, rotated
    by = {(r["ngram_size"], r["max_draft_tokens"]): r for r in rec["results"]}
    assert by[3, 8]["x_genai"] == pytest.approx(1.5) and by[2, 4]["x_genai"] == pytest.approx(0.9)
    assert rec["chosen"] == {"ngram_size": 3, "max_draft_tokens": 8}
    assert by[3, 8]["match_pct"] == pytest.approx(25.0) and by[3, 8]["identical"] == 0  # against genai plain
    assert by[4, 16]["match_pct"] == 100.0 and by[4, 16]["identical"] == 2
    assert by[2, 4]["acceptance_rate"] == pytest.approx(0.5) and by[2, 4]["tokens_per_forward"] == pytest.approx(7 / 4)
    assert rec["prompts"] == ["a", "b"] and len(rec["per_prompt"]) == 2


class _Refusing(_FakeGenai):
    """genai whose n-gram drafting fails on long prompts (Gemma-3's sliding-window KV cache cannot
    rewind a rejected draft past its window), and on prompts listed in ``plain_fails`` at all."""

    def __init__(self, speeds, long_ids: int, spec_fails=(), plain_fails=()):
        super().__init__(speeds, {})
        self.long_ids, self.spec_fails, self.plain_fails = long_ids, set(spec_fails), set(plain_fails)

    def generate(self, ids, max_new_tokens, *, ignore_eos=False, speculative=None):
        if len(ids) in self.plain_fails or (
            speculative and (len(ids) >= self.long_ids or speculative in self.spec_fails)
        ):
            raise BenchError(f"onnxruntime-genai's generator failed (prompt {len(ids)} ids): Cannot rewind")
        return super().generate(ids, max_new_tokens, ignore_eos=ignore_eos, speculative=speculative)


def test_ngram_sweep_leaves_out_what_genai_cannot_run_and_says_so():
    """A prompt on which every config fails is left out, a config that fails where others ran is
    not chosen, and both are recorded; when nothing runs, the sweep raises NgramCannotRun, which
    load_peers turns into one line: genai plain stays, genai-ngram is skipped."""
    chat = type("T", (), {"template": "{{ messages }}"})()
    lengths = {"short": [1, 2, 3], "long": list(range(40))}
    model = type("M", (), {"encode": staticmethod(lambda msgs: lengths[msgs[0]["content"]]), "tokenizer": chat})()
    prompts = [Prompt("a", "qa", "qa", ("short",)), Prompt("b", "rag", "rag", ("long",))]
    speeds = {None: 100.0, (2, 4): 90.0, (3, 8): 150.0, (4, 16): 120.0}
    genai = _Refusing(speeds, long_ids=30, spec_fails={(3, 8)})
    rec = NGRAM.run_ngram_sweep(model, genai, prompts, 8, ((2, 4), (3, 8), (4, 16)))
    assert [r["qid"] for r in rec["per_prompt"]] == ["a"]  # every config failed on the long prompt
    assert rec["configs"] == [[2, 4], [4, 16]] and rec["chosen"] == {"ngram_size": 4, "max_draft_tokens": 16}
    assert len(rec["failed"]) == 4 and all("Cannot rewind" in f for f in rec["failed"])
    with pytest.raises(NGRAM.NgramCannotRun, match="Cannot rewind"):
        NGRAM.run_ngram_sweep(model, _Refusing(speeds, long_ids=0), prompts, 8, ((2, 4), (3, 8)))


def test_a_peer_whose_ngram_drafting_cannot_run_leaves_genai_plain(tmp_path, monkeypatch, caplog):
    import logging

    from dejavuu_build.bench import genai as G

    plain = _FakeGenai({None: 100.0}, {})
    monkeypatch.setattr(G, "load_genai_peer", lambda *a, **k: (plain, None))

    def cannot(*a, **k):
        raise NGRAM.NgramCannotRun("onnxruntime-genai's n-gram speculation failed on the sweep prompts")

    monkeypatch.setattr(NGRAM, "ngram_peer", cannot)
    model = type("M", (), {"manifest": None, "eos_ids": ()})()
    ctx = type(
        "C",
        (),
        {
            "model": model,
            "cfg": BenchConfig(model="m", compare=("genai",)),
            "warmup_ids": [1, 2],
            "warmup_tokens": 2,
            **dict.fromkeys(("out", "corpus", "prompts", "fits", "resume")),
        },
    )()
    with caplog.at_level(logging.WARNING, logger="dejavuu"):
        assert G.load_peers(ctx) == [plain]
    assert "genai-ngram peer skipped, it cannot run this model here" in caplog.text


def test_ngram_options_fixed_resumed_or_refused(tmp_path, monkeypatch):
    genai = _FakeGenai({}, {})

    def no_sweep(*a, **k):
        raise AssertionError("swept although the options were given")

    monkeypatch.setattr(NGRAM, "run_ngram_sweep", no_sweep)
    fixed = BenchConfig(model="m", compare=("genai",), genai_ngram="4, 16")
    assert fixed.genai_ngram == "4,16" and fixed.timed[-2:] == ("genai", "genai-ngram")
    peer = NGRAM.ngram_peer(None, genai, fixed, tmp_path, [], [], lambda p: True, resume=False)
    assert (peer.options, peer.chosen_by, peer.name) == ((4, 16), "--genai-ngram", "genai-ngram")
    (tmp_path / NGRAM.SWEEP_FILE).write_text(
        json.dumps({"chosen": {"ngram_size": 2, "max_draft_tokens": 8}, "results": [], "per_prompt": []})
    )
    resumed = NGRAM.ngram_peer(
        None, genai, BenchConfig(model="m", compare=("genai",)), tmp_path, [], [], lambda p: True, resume=True
    )
    assert (resumed.options, resumed.chosen_by, resumed.sweep["file"]) == ((2, 8), "sweep", NGRAM.SWEEP_FILE)
    with pytest.raises(BenchError, match="outside the measured set"):
        NGRAM.sweep_prompts(
            [Prompt("1", "qa", "qa", ("x",))],
            BenchConfig(model="m", categories=("qa",)),
            [Prompt("1", "qa", "qa", ("x",))],
            lambda p: True,
        )


def test_sweep_prompts_are_the_next_of_each_category():
    ps = [
        Prompt(str(i), c, s, ("t",))
        for i, (c, s) in enumerate(
            [
                ("qa", "qa"),
                ("qa", "qa"),
                ("qa", "qa"),
                ("mt_bench", "writing"),
                ("mt_bench", "writing"),
                ("mt_bench", "roleplay"),
                ("mt_bench", "roleplay"),
            ]
        )
    ]
    from dejavuu_build.bench.config import select

    measured = select(ps, ("qa", "mt_bench"), 2)
    assert [p.qid for p in measured] == ["0", "1", "3", "5"]  # sources take turns
    assert [p.qid for p in select_next(ps, ("qa", "mt_bench"), measured, 1)] == ["2", "4"]
    assert [p.qid for p in select_next(ps, ("qa", "mt_bench"), measured, 5, lambda p: p.qid != "4")] == ["2", "6"]


def test_genai_ngram_flags():
    assert BenchConfig(model="m").genai_ngram == "off"  # no genai to run it beside
    assert BenchConfig(model="m", compare=("genai",)).genai_ngram == "sweep"
    assert BenchConfig(model="m", compare=("genai",), contexts=(64,)).genai_ngram == "off"
    assert "genai-ngram" not in BenchConfig(model="m", compare=("genai",), genai_ngram="off").timed
    for argv, msg in (
        (["--genai-ngram", "3,8"], "add --compare genai"),
        (["--compare", "genai", "--genai-ngram", "1,8"], "ngram_size 2..16"),
        (["--compare", "genai", "--genai-ngram", "3,17"], "max_draft_tokens 1..16"),
        (["--compare", "genai", "--genai-ngram", "3"], "NGRAM_SIZE,MAX_DRAFT_TOKENS"),
        (["--compare", "genai", "--genai-ngram", "3,8", "--no-genai-ngram"], "contradict"),
        (["--compare", "genai", "--genai-ngram", "3,8", "--contexts", "64"], "context sweep"),
    ):
        r = CliRunner().invoke(_cli(), ["bench", "--model", "m", *argv])
        assert r.exit_code == 2 and msg in r.output, (argv, r.output)


def test_a_peer_that_did_not_run_in_a_category_is_drawn_as_na_not_zero():
    """Where genai's n-gram drafting ran on no prompt of a category (Gemma's long prompts), its
    bar says n/a instead of showing a ratio of 0.00."""
    from dejavuu_build.bench.report import Row, bar_label, bar_value

    row = Row("rag", "auto", 5, 5, 640, 100.0, 1.0, 1.5, 10.0, 0.8, 3.0, 0.3, 20.0, 0.5, 100.0)
    row.x_peer = {"genai": 1.32, "genai-ngram": None}
    assert [bar_label(bar_value(row, k)) for k in ("", "genai", "genai-ngram")] == ["1.50", "1.32", "n/a"]
    assert bar_label(bar_value(None, "genai")) == "n/a"
