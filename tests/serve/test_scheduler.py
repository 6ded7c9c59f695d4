"""The scheduler in-process on a tiny random build: requests decoded together in one forward
give exactly the tokens each gives alone (every method, chain and tree, greedy and seeded
sampling); cancellation frees the slot; the drafter memory is bounded and namespaced."""

import json
import logging
import threading

import onnx
import pytest
from scheduling import run_all

from dejavuu_build import schema as S
from dejavuu_build.runtime import load
from dejavuu_build.runtime.drafters.base import DraftBudget
from dejavuu_build.runtime.settings import DecodeSettings
from dejavuu_build.serve.memory import Memory, MemorySuffixDecoding
from dejavuu_build.serve.scheduler import Cancelled, QueueFull, Request, Result, Scheduler

PROMPTS = [
    "abcabcabcabc abcabc",
    "the cat sat on the mat. the cat sat on the",
    "1 2 3 1 2 3 1 2 3",
    "hello hello hello",
    "xyz",
    "a b c d e f g a b c d e f g",
]


@pytest.fixture(scope="module")
def model(tiny_llama):
    """The default (int4-static, untimed as timed): what `serve` decodes, batched on its static
    batched graph (layouts.static.StaticBatch)."""
    m = load(tiny_llama)
    assert m.variant == S.read_manifest(tiny_llama).default_variant == "int4-static"
    return m


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_batched_requests_equal_each_alone(model, temperature):
    sched = Scheduler(model, max_batch=8, memory=Memory())
    try:
        assert sched.batched, sched.why_sequential
        methods = ["baseline", "pld", "suffix_decoding", "asam", "auto", "token_recycling", "lookahead", "pld"]
        jobs = []
        for i, m in enumerate(methods):
            prm = DecodeSettings(
                max_new_tokens=30 + 5 * i, temperature=temperature, seed=7 + i, method=m, tree=i % 2 == 1
            )
            jobs.append((model.encode(PROMPTS[i % len(PROMPTS)]), prm))
        got = run_all(sched, jobs)
        for (ids, prm), r in zip(jobs, got):
            assert isinstance(r, Result), r
            alone = model.generate(
                ids, method="baseline", max_new_tokens=prm.max_new_tokens, temperature=temperature, seed=prm.seed
            )
            assert r.tokens == alone.tokens, (prm.method, prm.tree)
            assert r.batched and r.stop_reason == alone.stop_reason
        assert sched.metrics.shared_forwards > 0  # requests really shared forwards
        assert sched.batch.active == 0  # every slot came back
    finally:
        sched.close()


def test_cancel_frees_the_slot_and_others_continue(model):
    sched = Scheduler(model, max_batch=4)
    try:
        started = threading.Event()
        res = {}
        victim = Request(
            model.encode(PROMPTS[0]),
            DecodeSettings(max_new_tokens=400, method="baseline"),
            lambda t: started.set(),
            lambda r: res.setdefault("victim", r),
        )
        sched.submit(victim)
        assert started.wait(30)
        victim.cancel()
        other_ids = model.encode(PROMPTS[1])
        (other,) = run_all(sched, [(other_ids, DecodeSettings(max_new_tokens=20, method="pld"))])
        assert isinstance(res["victim"], Cancelled)
        assert other.tokens == model.generate(other_ids, max_new_tokens=20).tokens
        assert sched.batch.active == 0 and sched.active_count() == 0
        assert sched.metrics.requests["cancelled"] == 1
    finally:
        sched.close()


def test_queue_bound(model):
    sched = Scheduler(model, max_batch=1, max_queue=1)
    gate = threading.Event()
    try:
        # the first request blocks the worker inside its token callback until the gate opens
        sched.submit(
            Request(
                model.encode(PROMPTS[0]),
                DecodeSettings(max_new_tokens=5, method="auto"),
                lambda t: gate.wait(30),
                lambda r: None,
            )
        )
        sched.submit(
            Request(
                model.encode(PROMPTS[1]),
                DecodeSettings(max_new_tokens=5, method="auto"),
                lambda t: None,
                lambda r: None,
            )
        )
        with pytest.raises(QueueFull):
            for _ in range(3):
                sched.submit(
                    Request(
                        model.encode(PROMPTS[2]),
                        DecodeSettings(max_new_tokens=5, method="auto"),
                        lambda t: None,
                        lambda r: None,
                    )
                )
    finally:
        gate.set()
        sched.close()


def test_memory_is_bounded_and_namespaced():
    mem = Memory(max_tokens=200, max_namespaces=2)
    doc = list(range(100, 160))
    mem.add("a", doc)
    drafter = MemorySuffixDecoding(mem.index("a"))
    drafter.begin([7, 8, 100, 101, 102])
    draft = drafter.propose([7, 8, 100, 101, 102], DraftBudget(max_nodes=4, max_depth=4))
    assert draft.tokens == [103, 104, 105]  # namespace a's document, as long as the match (spec_factor 1)
    other = MemorySuffixDecoding(mem.index("b"))
    other.begin([7, 8, 100, 101, 102])
    assert other.propose([7, 8, 100, 101, 102], DraftBudget(max_nodes=4, max_depth=4)).tokens == []
    for k in range(10):  # 10 x 61 tokens > 200: the oldest go
        mem.add("a", list(range(1000 + 100 * k, 1060 + 100 * k)))
    assert mem.tokens("a") <= 200 and mem.evicted_tokens > 0
    mem.index("c")  # a third namespace evicts the least recent
    assert len(mem.namespaces) == 2 and "b" not in mem.namespaces


def test_a_server_without_variant_serves_the_default_batched(tiny_llama):
    """`serve` without --variant decodes the manifest's default (what `generate` runs) and batches
    it on the batched graph the build wrote from that same variant: one model, one answer
    (tests/serve/test_one_answer.py compares the texts through a real server). Another variant
    (the rowwise twin) has no batched graph of its own and is served one request per forward."""
    from dejavuu_build.serve.cli import ServeConfig, build_app

    m = S.read_manifest(tiny_llama)
    assert m.batched["variant"] == m.default_variant == "int4-static"
    app, sched = build_app(ServeConfig(name=str(tiny_llama)))
    try:
        assert sched.model.variant == m.default_variant
        assert sched.batched and sched.model.contract.kv_layout == "static", sched.why_sequential
    finally:
        sched.close()
    app, sched = build_app(ServeConfig(name=str(tiny_llama), variant="int4-rowwise"))
    try:
        assert not sched.batched and "--variant int4-static" in sched.why_sequential
    finally:
        sched.close()


def test_the_build_writes_and_gates_the_batched_graph(tiny_llama):
    """The batched graph is part of the entry: one file, for the default variant (static: its
    static batched flavour), listed with its sha256, gated (requests side by side bit-identical to
    each alone, past 64 and 256 positions) on the machine that built it."""
    m = S.read_manifest(tiny_llama)
    b = m.batched
    v = m.default_variant
    assert b["file"] == S.batched_file(v) and (tiny_llama / b["file"]).is_file()
    assert b["layout"] == "static"
    assert m.files[b["file"]] == {"sha256": b["sha256"], "bytes": b["bytes"]}
    assert b["source_sha256"] == m.variants[v].sha256
    assert b["passed"] and b["graph_version"] == S.BATCHED_GRAPH_VERSION
    g = b["gate"]
    assert g["requests"] == 3 and g["mismatches"] == 0 and g["machine"]
    assert max(p + sum(st) for p, st in zip(g["pasts"], g["steps"])) > 256  # steps cross 64 and 256 positions
    assert [f.name for f in tiny_llama.iterdir() if ".batched." in f.name] == [b["file"]]
    assert any(n.startswith(f"batched serving graph of {v}") for n, _ in m.steps)
    # its weights are the variant's, read from the variant's own file (export.shared_weights)
    # (a tiny model: tensors under 1 KB stay inline; SmolLM2-135M: 151.9 MB shared, 0.2 MB left)
    assert b["shared_bytes"] > 0.75 * m.variants[v].bytes and b["bytes"] < 0.5 * m.variants[v].bytes
    g = onnx.load(str(tiny_llama / b["file"]), load_external_data=False)
    locations = {e.value for t in g.graph.initializer for e in t.external_data if e.key == "location"}
    assert locations == {m.variants[v].file}


def test_a_batched_graph_made_from_other_bytes_is_not_served(tiny_llama, caplog):
    """The batched graph reads its weights inside the variant's file: a record whose source is not
    the file the entry holds is refused (one line, decoding one request per forward), never run."""
    from conftest import clone_entry

    from dejavuu_build.serve.cli import ServeConfig, build_app

    folder = clone_entry(tiny_llama, "tiny-llama-other-source")
    d = json.loads((folder / S.MANIFEST_FILE).read_text())
    d["batched"]["source_sha256"] = "0" * 64
    S.write_json(folder / S.MANIFEST_FILE, d)
    with caplog.at_level(logging.WARNING, logger="dejavuu"):
        app, sched = build_app(ServeConfig(name="tiny-llama-other-source"))
    try:
        assert not sched.batched and "made from another" in sched.why_sequential
    finally:
        sched.close()


def test_a_rebuild_of_only_the_variant_bytes_after_load_is_not_batched_on(tiny_llama):
    """The batched file holds no weights, so a rebuild that changed only its variant's bytes keeps
    the batched file's own sha256: the server tells it by the recorded source sha256 instead, and
    does not batch on weights other than those its model decodes with."""
    from conftest import clone_entry

    from dejavuu_build.serve.batch import BatchUnavailable, open_batch

    folder = clone_entry(tiny_llama, "tiny-llama-rebuilt-variant")
    model = load(folder)
    d = json.loads((folder / S.MANIFEST_FILE).read_text())
    d["batched"]["source_sha256"] = "f" * 64  # what a rebuild with other variant bytes records
    S.write_json(folder / S.MANIFEST_FILE, d)
    with pytest.raises(BatchUnavailable, match="rebuilt since"):
        open_batch(model, 2)


def test_an_entry_built_before_the_batched_graph_still_serves(tiny_llama, caplog):
    """An entry whose manifest has no batched graph (built before the build wrote it) serves its
    default one request per forward, with one line saying to rebuild it."""
    from conftest import clone_entry

    from dejavuu_build.serve.cli import ServeConfig, build_app

    folder = clone_entry(tiny_llama, "tiny-llama-old")
    m = S.read_manifest(folder)
    (folder / m.batched["file"]).unlink()
    del m.files[m.batched["file"]]
    d = m.to_json()
    del d["batched"]  # what an older build wrote
    S.write_json(folder / S.MANIFEST_FILE, d)
    with caplog.at_level(logging.WARNING, logger="dejavuu"):
        app, sched = build_app(ServeConfig(name="tiny-llama-old"))
    try:
        assert not sched.batched and sched.model.variant == m.default_variant
        lines = [r.getMessage() for r in caplog.records if "one request at a time" in r.getMessage()]
        assert len(lines) == 1 and "rebuild it with" in lines[0] and "no batched graph" in lines[0], lines
        ids = sched.model.encode(PROMPTS[1])
        (r,) = run_all(sched, [(ids, DecodeSettings(max_new_tokens=20, method="pld"))])
        assert not r.batched and r.tokens == sched.model.generate(ids, max_new_tokens=20).tokens
    finally:
        sched.close()


def test_a_request_at_the_cache_end_decodes_as_alone_beside_a_wide_one(model):
    """A request with little KV room left shares steps with one verifying long chains: the batched
    step pads every request to the widest one, which would not fit the first's room. It must decode
    exactly as alone (its rows run in a forward of their own where needed) and fail nobody."""
    sched = Scheduler(model, max_batch=4, memory=Memory())
    try:
        assert sched.batched, sched.why_sequential
        cap = sched.batch.capacity
        n_new = 6
        near = model.encode("the cat sat on the mat. " * 200)[: cap - n_new - 2]  # room for its own 2-row steps only
        wide = model.encode(PROMPTS[0] * 4)
        jobs = [
            (near, DecodeSettings(max_new_tokens=n_new, method="baseline")),
            (wide, DecodeSettings(max_new_tokens=160, method="pld", max_depth=16)),
        ]
        got = run_all(sched, jobs)
        for (ids, prm), r in zip(jobs, got):
            assert isinstance(r, Result), r
            alone = model.generate(ids, method="baseline", max_new_tokens=prm.max_new_tokens)
            assert r.tokens == alone.tokens and r.batched
        assert sched.metrics.shared_forwards > 0
        assert sched.batch.split_forwards > 0  # the near one's rows ran in a forward of their own at least once
    finally:
        sched.close()


def test_the_server_prefills_a_prompt_as_the_engine_does(model, tiny_llama):
    """BatchDriver.prefill on the static batched graph: each chunk runs on the decoder's own
    prefill (the lm-head on its last row only: one row of logits back for a chunk of many), and the
    slot's K/V are bit-equal to the engine's prefill of the same prompt, chunk for chunk."""
    import numpy as np

    from dejavuu_build.layouts import Rows
    from dejavuu_build.layouts.static import StaticBatch
    from dejavuu_build.serve.batch import open_batch

    batch = open_batch(model, 2)
    assert isinstance(batch, StaticBatch)
    C = S.PREFILL_CHUNK
    ids = np.random.default_rng(3).integers(0, model.contract.vocab_size, C + 40).tolist()
    dec = model.decoder
    kv = dec.new_cache()
    want = []
    for i in range(0, len(ids), C):
        part = ids[i : i + C]
        lg, _, pr = dec.prefill(part, kv, len(ids), 8)
        want.append(lg.copy())
        kv.commit(pr, len(part), list(range(len(part))))
    ref = kv.buffers()[:, 0, :, : len(ids)].copy()
    kv.release()
    slot = batch.acquire("r")
    for j, i in enumerate(range(0, len(ids), C)):
        part = ids[i : i + C]
        lg, _ = batch.prefill(slot, Rows(part, None), len(ids), 8)
        assert lg.shape[0] < len(part) and np.array_equal(lg[-1], want[j][-1])
        batch.commit(slot, len(part), list(range(len(part))))
    assert batch.lengths[slot] == len(ids) and not batch._prefilling
    assert np.array_equal(batch.buf[:, slot, :, : len(ids)], ref)
    batch.release(slot)
