"""Issue 25 (trust, round two), the Python API: one Model shared by threads answers each as if
alone, a stream stops when its consumer stops (break, close, a closed pipe, interpreter exit)
and leaves the Model ready, token ids and tiny temperatures are checked or handled at the API,
and a cache name loads only through its manifest."""

import os
import subprocess
import sys
import threading

import numpy as np
import pytest
from conftest import clone_entry

from dejavuu_build import schema as S
from dejavuu_build.errors import CacheError, GenerationError
from dejavuu_build.runtime import load
from dejavuu_build.runtime.sampling import Sampler

PROMPTS = ["abcabcabc abc", "the cat sat on the mat. the cat", "1 2 3 1 2 3 1 2", "hello hello hello"]


@pytest.fixture(scope="module", params=["default", "int4-rowwise"])
def model(tiny_llama, request):
    """The in-place layouts, whose decoders reuse buffers between steps: the default (int4-static,
    what a build picks, timed or not) and the rowwise twin (pinned)."""
    if request.param == "default":
        m = load(tiny_llama)
        assert m.variant == "int4-static"
        return m
    return load(tiny_llama, variant=request.param)


# ---------------------------------------------------------------- point 2: threads and streams
def test_one_model_shared_by_threads_answers_each_as_alone(model):
    kw = [
        dict(max_new_tokens=40),
        dict(max_new_tokens=40, method="pld"),
        dict(max_new_tokens=40, temperature=0.8, seed=3),
        dict(max_new_tokens=40, method="suffix_decoding"),
    ]
    alone = [model.generate(p, **k).tokens for p, k in zip(PROMPTS, kw)]
    for _ in range(3):
        got = [None] * 4
        start = threading.Barrier(4)

        def one(i, start=start, got=got):
            start.wait()
            got[i] = model.generate(PROMPTS[i], **kw[i]).tokens

        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert got == alone


def test_a_generate_from_its_own_callback_is_refused(model):
    seen = []

    def again(_ids):
        if not seen:
            seen.append(1)
            model.generate("abc", max_new_tokens=2)

    with pytest.raises(GenerationError, match="inside a callback"):
        model.generate("abc", max_new_tokens=4, on_tokens=again)
    assert model.generate(PROMPTS[1], max_new_tokens=20).tokens == model.generate(PROMPTS[1], max_new_tokens=20).tokens


def test_breaking_out_of_a_stream_stops_it_and_leaves_the_model_ready(model):
    ref = model.generate(PROMPTS[1], max_new_tokens=40)
    threads = threading.active_count()
    for _ in model.stream(PROMPTS[0], max_new_tokens=400):
        break
    assert threading.active_count() == threads  # its worker stopped and was waited for
    assert model.generate(PROMPTS[1], max_new_tokens=40).tokens == ref.tokens
    g = model.stream(PROMPTS[0], max_new_tokens=400)
    next(g)
    g.close()
    assert threading.active_count() == threads
    assert "".join(model.stream(PROMPTS[1], max_new_tokens=40)) == ref.text


_SCRIPT = """
import sys
from dejavuu_build.runtime import load
m = load({folder!r})
g = m.stream("abcabcabc abc", max_new_tokens=400)
print(next(g), flush=True)
if sys.argv[1] == "break":
    for piece in m.stream("abcabcabc abc", max_new_tokens=400):
        break
    print("AFTER", m.generate("hello hello", max_new_tokens=8).tokens, flush=True)
    g.close()
# "open": exit while the stream is still open
"""


@pytest.mark.parametrize("how", ["break", "open"])
def test_a_script_that_leaves_a_stream_exits_cleanly(tiny_llama, cache_dir, how):
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT.format(folder=str(tiny_llama)), how],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, DEJAVUU_CACHE=str(cache_dir)),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "terminate called" not in out.stderr
    if how == "break":
        assert "AFTER" in out.stdout


def test_generate_stream_into_a_closed_pipe_stops_quietly(tiny_llama, cache_dir):
    """`dejavuu-build generate N "..." --stream | head -c 20`: no traceback, no abort."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dejavuu_build.build.cli",
            "generate",
            str(tiny_llama),
            "abcabcabc abc",
            "--stream",
            "--max-new-tokens",
            "480",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(os.environ, DEJAVUU_CACHE=str(cache_dir)),
    )
    head = proc.stdout.read(20)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    rc = proc.wait(300)
    assert len(head) == 20
    assert rc == 141, (rc, err[-2000:])  # the shell's status for a writer whose reader left
    assert "unexpected" not in err and "Traceback" not in err and "terminate called" not in err, err[-2000:]


# ---------------------------------------------------------------- point 4: token ids are checked at the API
@pytest.mark.parametrize("variant", ["int4", "fp32"])
def test_token_ids_outside_the_vocabulary_are_refused(tiny_llama, variant):
    m = load(tiny_llama, variant=variant)
    V = m.contract.vocab_size
    bad = [
        [1, 2, V],
        [1, 2, 60000],
        [1, 2, 2**31],
        [1, -1],
        [-V],
        [[1, 2]],
        [2**70],
        np.array([[1, 2]]),
        np.array([1.0, 2.0]),
        [True, 1],
        [1.5],
        ["a", "b"],
        [{"role": "user", "content": "hi"}, "x"],
        [{"role": "user"}, {"content": 3}],
    ]
    for p in bad:
        with pytest.raises(GenerationError):
            m.generate(p, max_new_tokens=2)
    assert m.generate([1, 2, V - 1], max_new_tokens=2).stats.tokens == 2
    assert m.generate(np.array([1, 2, 3], np.int32), max_new_tokens=2).stats.tokens == 2


def test_draft_model_must_be_a_name_or_another_model(model):
    for dm, needle in ((5, "draft_model must be"), ("tiny-llama:", "names no variant"), (model, "itself")):
        with pytest.raises(GenerationError, match=needle):
            model.generate("abc", method="draft_model", draft_model=dm, max_new_tokens=2)


# ---------------------------------------------------------------- point 5: subnormal temperatures
@pytest.mark.parametrize("t", [1e-320, 5e-324, 1e-300])
def test_a_subnormal_temperature_samples_the_top_token(model, t):
    x = np.array([0.5, 3.0, -2.0, 2.9], np.float32)
    for top_k, top_p in ((0, 1.0), (2, 1.0), (0, 0.5)):
        p = Sampler(temperature=t, top_k=top_k, top_p=top_p).probs(x)
        assert np.isfinite(p).all() and p.tolist() == [0.0, 1.0, 0.0, 0.0]
    greedy = model.generate(PROMPTS[0], max_new_tokens=24).tokens
    assert model.generate(PROMPTS[0], max_new_tokens=24, temperature=t, seed=5).tokens == greedy


# ---------------------------------------------------------------- point 3: a cache name loads only through its manifest
def test_an_entry_without_its_manifest_is_refused_by_every_road(tiny_llama, tmp_path):
    folder = clone_entry(tiny_llama, "no-manifest")
    (folder / S.MANIFEST_FILE).unlink()
    for target in ("no-manifest", folder, folder / S.variant_file("int4"), folder / S.variant_file("fp32-rowwise")):
        with pytest.raises(CacheError, match="has no manifest.json.*move that folder away"):
            load(target)
    # a third-party export outside the cache, without manifest or contract, still loads on its graph
    (tmp_path / "third").mkdir()
    (tmp_path / "third" / "model.onnx").write_bytes((tiny_llama / S.variant_file("fp32")).read_bytes())
    assert load(tmp_path / "third").generate([1, 2, 3], max_new_tokens=2).stats.tokens == 2


def test_an_empty_variant_name_is_refused(tiny_llama):
    for v in ("", " ", 4):
        with pytest.raises(CacheError, match="variant must name"):
            load(tiny_llama, variant=v)
