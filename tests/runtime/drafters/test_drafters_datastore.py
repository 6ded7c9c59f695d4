"""Datastore build / save / load, file readers, and the retrieval drafters that use it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dejavuu_build.runtime.drafters import Datastore, DraftBudget, build_from_file, make_drafter
from dejavuu_build.runtime.drafters.datastore import read_documents

SPEC_BENCH = Path("/work/shared/data/spec_bench/question.jsonl")


def byte_encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def test_build_separates_documents():
    ds = Datastore.build([[1, 2, 3], [], [1, 2, 4]])
    assert ds.n_docs == 2 and ds.tokens.tolist() == [1, 2, 3, -1, 1, 2, 4, -1]
    assert ds.index.match_ends([1, 2]) == [6, 2]
    assert ds.index.continuation(2, 5) == [3]  # stops at the document end
    assert ds.index.longest_match([9, 3]) == 0  # "3" is only followed by the separator
    with pytest.raises(ValueError):
        Datastore.build([[1, -5]])


def test_save_load_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 30, rng.integers(1, 200)).tolist() for _ in range(40)]
    ds = Datastore.build(docs, max_len=16)
    ds.index.extend([3, 4, 5, -1])  # appended after build: save must fold it in
    out = ds.save(tmp_path / "ds")
    meta = json.loads((out / "datastore.json").read_text())
    assert meta["version"] == 1 and meta["n_tokens"] == ds.n_tokens and meta["max_len"] == 16
    assert {p.name for p in out.iterdir()} == {"tokens.npy", "suffixes.npy", "datastore.json"}
    back = Datastore.load(out)
    assert back.n_docs == ds.n_docs and np.array_equal(back.tokens, ds.tokens)
    assert np.array_equal(back.index.sorted_positions(), ds.index.sorted_positions())
    for pat in ([1], [2, 3], docs[0][:4], docs[7][-3:]):
        assert back.index.find(pat) == ds.index.find(pat)
        assert back.index.match_ends(pat) == ds.index.match_ends(pat)


def test_load_rejects_other_formats(tmp_path):
    Datastore.build([[1, 2]]).save(tmp_path)
    meta = json.loads((tmp_path / "datastore.json").read_text())
    meta["version"] = 99
    (tmp_path / "datastore.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="version"):
        Datastore.load(tmp_path)
    with pytest.raises(FileNotFoundError):
        Datastore.load(tmp_path / "missing")


@pytest.mark.skipif(not SPEC_BENCH.exists(), reason="Spec-Bench data not present")
def test_build_from_spec_bench_jsonl():
    rows = [json.loads(line) for line in SPEC_BENCH.read_text().splitlines() if line.strip()]
    n_turns = sum(len([t for t in r["turns"] if t.strip()]) for r in rows)
    ds = build_from_file(SPEC_BENCH, byte_encode)
    assert ds.n_docs == n_turns
    first = byte_encode(rows[0]["turns"][0])
    assert ds.tokens[: len(first)].tolist() == first
    # REST retrieves a turn's continuation from its own prefix
    prefix = byte_encode("Compose an engaging travel blog post about a recent trip to")
    rest = make_drafter("rest", datastore=ds)
    rest.begin(prefix)
    draft = rest.propose(prefix, DraftBudget(max_nodes=6, max_depth=6))
    assert bytes(draft.tokens).decode() == " Hawai"


def test_read_documents_txt_and_chat_rows(tmp_path):
    txt = tmp_path / "corpus.txt"
    txt.write_text("para one\nline two\n\n\npara two\n")
    assert list(read_documents(txt)) == ["para one\nline two", "para two"]
    jl = tmp_path / "rows.jsonl"
    jl.write_text(json.dumps({"text": "a"}) + "\n\n" + json.dumps({"turns": [{"content": "b"}, "c"], "x": "y"}) + "\n")
    assert list(read_documents(jl)) == ["a", "b", "c"]
    with pytest.raises(ValueError):
        list(read_documents(tmp_path / "data.csv"))


def test_make_drafter_accepts_a_saved_directory(tmp_path):
    Datastore.build([[5, 6, 7, 8, 9]]).save(tmp_path)
    for name in ("rest", "sam_decoding", "asam", "asam_verify"):
        d = make_drafter(name, datastore=str(tmp_path))
        d.begin([1, 5, 6])
        assert d.propose([1, 5, 6], DraftBudget(3, 3)).tokens == [7, 8, 9], name


def test_sam_prefers_the_longer_match_of_datastore_and_live_context():
    ds = Datastore.build([[1, 2, 3, 4, 5, 6]])
    sam = make_drafter("sam_decoding", datastore=ds)
    live = [9, 2, 3, 7, 0, 2, 3]  # live "2 3" -> 7; datastore "1 2 3"? no: only "2 3" -> 4
    sam.begin(live)
    assert sam.propose(live, DraftBudget(1, 1)).tokens == [7]  # equal length: live wins
    longer = [0, 1, 2, 3]
    sam.begin(longer + [8] + longer)
    assert sam.propose(longer + [8] + longer, DraftBudget(2, 2)).tokens == [8, 0]  # live "0 1 2 3" beats "1 2 3"
    ctx = [7, 1, 2, 3]
    sam.begin(ctx)
    assert sam.propose(ctx, DraftBudget(2, 2)).tokens == [4, 5]  # datastore "1 2 3" beats nothing
