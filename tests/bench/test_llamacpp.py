"""`bench --compare llamacpp`: the source GGUF in llama.cpp (plain and prompt lookup) beside our
methods, on a tiny Llama GGUF with Q4_1 blocks that our build carries and llama.cpp runs as is."""

from __future__ import annotations

import csv
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from dejavuu_build.bench import BenchConfig, run_bench
from dejavuu_build.bench import llamacpp as L

pytest.importorskip("llama_cpp_py_sync")

PROMPTS = [
    {"question_id": 1, "category": "qa", "turns": ["hello world hello world hello world hello"]},
    {"question_id": 81, "category": "writing", "turns": ["abc abc abc abc abc", "hello hello"]},
]


def bench_llamacpp(model: Path, tmp_path: Path, max_new_tokens: int):
    """``pld`` beside llama.cpp (plain and lookup) on PROMPTS (one qa, one two-turn mt_bench) into
    ``tmp_path / "run"``; the report."""
    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    cfg = BenchConfig(
        model=str(model),
        methods=("pld",),
        categories=("qa", "mt_bench"),
        per_category=1,
        max_new_tokens=max_new_tokens,
        threads=1,
        data=str(data),
        compare=("llamacpp",),
    )
    return run_bench(cfg, tmp_path / "run")


@pytest.fixture(scope="module")
def gguf_build(cache_dir, tmp_path_factory):
    from tiny import tiny_llama_gguf

    from dejavuu_build.build.config import TreeDecoderConfig
    from dejavuu_build.build.pipeline import build_tree_decoder

    src = tiny_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny-q4_1.gguf")
    cfg = TreeDecoderConfig(model=str(src), name="tiny-gguf-llamacpp", variants=("fp32", "int4"), timing=False)
    return build_tree_decoder(cfg).folder


def test_lookup_draft_is_llama_cpp_pythons_prompt_lookup():
    # the last 2 ids (7, 8) first occur at 1..2: the 3 ids after them
    assert L.lookup_draft([5, 7, 8, 1, 2, 3, 9, 7, 8], 2, 3) == [1, 2, 3]
    # no 2-gram match: the last id alone (8) first occurs at 2, followed by 4 5
    assert L.lookup_draft([1, 8, 4, 5, 6, 0, 8], 2, 2) == [4, 5]
    # a match without num_pred_tokens whole ids after it is skipped
    assert L.lookup_draft([1, 2, 9, 1, 2], 2, 4) == []
    assert L.lookup_draft([1, 2, 9, 1, 2], 2, 3) == [9, 1, 2]
    assert L.lookup_draft([1, 2, 9, 4, 1, 2], 2, 3) == [9, 4, 1]
    assert L.lookup_draft([3], 2, 3) == [] and L.lookup_draft([1, 2, 3, 4], 2, 3) == []


def test_the_wheels_library_loads_on_this_glibc(tmp_path):
    """The wheel's libraries need glibc 2.38 only for four C23 parsers: where this glibc is older,
    the patched copy rewrites exactly those and loads; on a newer glibc nothing is rewritten."""
    import llama_cpp_py_sync

    lib = Path(llama_cpp_py_sync.__file__).parent / "libllama.so"
    data = bytearray(lib.read_bytes())
    rewritten = L.patch_c23(bytearray(data), (2, 36))
    assert rewritten == 4  # __isoc23_sscanf, strtol, strtoul, strtoull
    assert L.patch_c23(bytearray(data), (2, 41)) == 0
    once = bytearray(data)
    L.patch_c23(once, (2, 36))
    assert L.patch_c23(once, (2, 36)) == 0  # nothing newer is needed any more
    copy = L.glibc_compat_copy(lib.parent, tmp_path)
    assert copy.is_file() and copy.parent.parent == tmp_path / ".peers"
    ffi, loaded, path = L.require_llamacpp(tmp_path)
    assert "CPU" in ffi.string(loaded.llama_print_system_info()).decode()


def test_llamacpp_peer_runs_the_source_gguf(gguf_build, tmp_path):
    from dejavuu_build.schema import read_manifest

    m = read_manifest(gguf_build)
    peers, why = L.load_llamacpp_peers(m, 1, [2])
    assert why is None and [p.name for p in peers] == ["llamacpp", "llamacpp-lookup"]
    plain, lookup = peers
    ids = [int(t) for t in np.random.default_rng(3).integers(3, 40, 12)] * 3  # repeats: lookup drafts
    a = plain.generate(ids, 24, ignore_eos=True)
    assert len(a.tokens) == 24 and a.steps == 23 and a.prefill_s > 0 and a.decode_s > 0
    # greedy: every token is the argmax of llama.cpp's own teacher-forced logits at its position
    logits = plain.logits(ids + a.tokens[:-1])
    assert logits.shape == (len(ids) + 23, plain.n_vocab)
    assert sum(int(x == y) for x, y in zip(logits[len(ids) - 1 :].argmax(-1), a.tokens)) >= 23
    b = lookup.generate(ids, 24, ignore_eos=True)
    spec = b.speculative
    assert spec["draft_tokens_evaluated"] > 0 and b.steps == spec["forwards"] < 23  # drafts were verified
    assert sum(int(x == y) for x, y in zip(a.tokens, b.tokens)) >= 20  # its own plain decoding, near-ties aside
    # the peer refuses a file that is not the build's source
    other = tmp_path / "other.gguf"
    shutil.copy(m.source["path"], other)
    with open(other, "r+b") as f:
        f.seek(-1, 2)
        f.write(b"\x01")
    with pytest.raises(L.PeerError, match="sha256 differs"):
        L.source_gguf(type("M", (), {"source": {**m.source, "path": str(other)}})())


def test_bench_compare_llamacpp_end_to_end(gguf_build, tmp_path):
    report = bench_llamacpp(gguf_build, tmp_path, 10)
    recs = [json.loads(x) for x in (tmp_path / "run" / "records.jsonl").read_text().splitlines()]
    plain = [r for r in recs if r["method"] == "llamacpp"]
    lookup = [r for r in recs if r["method"] == "llamacpp-lookup"]
    assert len(plain) == len(lookup) == 3 and not any(r["gated"] for r in plain + lookup)
    ours = {(r["qid"], r["turn"]): r for r in recs if r["method"] == "baseline"}
    assert all(r["prompt_tokens"] == ours[r["qid"], 1]["prompt_tokens"] for r in plain if r["turn"] == 1)
    own = {(r["qid"], r["turn"]): r["ids"] for r in plain}
    for r in lookup:  # matched with llama.cpp's own plain decoding of the same prompt and turn
        assert r["plain_match"] == (r["ids"] == own[r["qid"], r["turn"]])
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    assert res["gate"]["passed"] and {"llamacpp", "llamacpp-lookup"} <= set(res["gate"]["not_gated"])
    assert res["peers"]["llamacpp"]["gguf"] == read_source(gguf_build)
    assert res["peers"]["llamacpp-lookup"]["vs_plain"]["plain"] == "llamacpp"
    assert res["peers"]["llamacpp-lookup"]["speculative"]["num_pred_tokens"] == L.LOOKUP[1]
    q = res["peers"]["llamacpp"]["quality"]
    assert 0.0 <= q["top1"] <= 1.0 and q["positions"] > 0
    for m in ("baseline", "pld", "llamacpp", "llamacpp-lookup"):
        row = report.row("overall", m)
        assert row.x_peer["llamacpp"] is not None and row.x_peer["llamacpp-lookup"] is not None
    assert report.row("overall", "llamacpp").x_peer["llamacpp"] == pytest.approx(1.0)
    assert report.row("overall", "llamacpp-lookup").match_plain_pct is not None
    # the copy oracle's share is ours to take: a peer's speed over our baseline is other kernels
    assert report.row("overall", "pld").oracle_share is not None
    assert report.row("overall", "llamacpp").oracle_share is None
    assert report.row("overall", "llamacpp").oracle_speedup == report.row("overall", "pld").oracle_speedup
    table = report.table()
    assert "× llamacpp" in table and "× llamacpp-lookup" in table and "vs plain" in table
    rows = list(csv.DictReader((tmp_path / "run" / "results.csv").open()))
    assert {"x_llamacpp", "x_llamacpp_lookup", "match_plain_pct"} <= set(rows[0])
    assert (tmp_path / "run" / "speedup.png").stat().st_size > 0


def test_a_base_model_without_chat_template_is_benched_on_plain_text(cache_dir, tmp_path):
    """Spec-Bench rows are chat turns; a base model's GGUF has no chat template (Gemma-3-270M's):
    the run sends each conversation as plain text, to every method and peer alike, and says so."""
    from tiny import tiny_llama_gguf

    from dejavuu_build.build.config import TreeDecoderConfig
    from dejavuu_build.build.pipeline import build_tree_decoder
    from dejavuu_build.runtime import load

    src = tiny_llama_gguf(tmp_path / "base.gguf", chat=False)
    folder = build_tree_decoder(TreeDecoderConfig(model=str(src), name="tiny-gguf-base", timing=False)).folder
    bench_llamacpp(folder, tmp_path, 8)
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    assert res["gate"]["passed"] and res["prompt_format"].startswith("text")
    recs = [json.loads(x) for x in (tmp_path / "run" / "records.jsonl").read_text().splitlines()]
    model = load(str(folder))
    first = model.encode(PROMPTS[0]["turns"][0])
    for m in ("baseline", "pld", "llamacpp", "llamacpp-lookup"):  # the same text's ids, to all
        assert next(r for r in recs if r["method"] == m and r["qid"] == "1")["prompt_tokens"] == len(first)
    base2 = next(r for r in recs if r["method"] == "baseline" and r["qid"] == "81" and r["turn"] == 2)
    turn1 = next(r for r in recs if r["method"] == "baseline" and r["qid"] == "81" and r["turn"] == 1)
    text2 = "\n\n".join([PROMPTS[1]["turns"][0], model.tokenizer.decode(turn1["ids"]), PROMPTS[1]["turns"][1]])
    assert base2["prompt_tokens"] == len(model.encode(text2))  # the answer is part of the next turn's text


def read_source(folder: Path) -> str:
    from dejavuu_build.schema import read_manifest

    return read_manifest(folder).source["path"]


def test_a_peer_failing_on_a_prompt_is_one_line_and_the_run_goes_on(gguf_build, tmp_path, monkeypatch, caplog):
    """genai's n-gram decoding refused a long Gemma prompt mid-run (its sliding-window cache could
    not rewind): a peer's BenchError on one prompt skips that peer there, and everything else runs."""
    calls: list[int] = []

    def refuse(self, ids, max_new_tokens, *, ignore_eos=False):
        calls.append(len(ids))
        if len(calls) == 3:  # the warm-up, the first prompt, then the two-turn prompt's first turn: refused
            raise L.PeerError("cannot rewind")
        return self.peer._generate([int(t) for t in ids], max_new_tokens, ignore_eos, self.options)

    monkeypatch.setattr(L.LlamaCppLookup, "generate", refuse)
    with caplog.at_level("WARNING"):
        report = bench_llamacpp(gguf_build, tmp_path, 6)
    recs = [json.loads(x) for x in (tmp_path / "run" / "records.jsonl").read_text().splitlines()]
    lookup = {(r["qid"], r["turn"]) for r in recs if r["method"] == "llamacpp-lookup"}
    plain = {(r["qid"], r["turn"]) for r in recs if r["method"] == "llamacpp"}
    assert plain == {("1", 1), ("81", 1), ("81", 2)} and lookup == {("1", 1)}  # skipped where it refused
    assert any("llamacpp-lookup skipped on prompt" in m and "cannot rewind" in m for m in caplog.messages)
    assert report.row("overall", "pld").x_peer["llamacpp"] is not None


def test_openmp_spins_briefly_unless_the_user_chose(monkeypatch):
    """The peer's OpenMP wait policy (module docstring: measured): a short spin by default, the
    user's own setting untouched."""
    from dejavuu_build.bench import llamacpp

    for var in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(var, raising=False)
    llamacpp.require_llamacpp()
    assert os.environ["GOMP_SPINCOUNT"] == llamacpp.SPINCOUNT and "OMP_WAIT_POLICY" not in os.environ
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    llamacpp.require_llamacpp()
    assert "GOMP_SPINCOUNT" not in os.environ and os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
