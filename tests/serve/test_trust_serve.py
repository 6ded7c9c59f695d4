"""Issue 25 (trust, round two), the server: its batched graph (written and gated by the build) is
checked against the manifest on every start and refused when wrong (truncated, edited, lost), a
graph that fails its gate is never batched on, serving writes nothing, a large prompt does not stall
the event loop, a body of any depth is a 400, a taken port fails before "serving ...", and bad
bounds are one line. The server runs as a real process where the existing tests do so."""

import logging
import socket
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest
from click.testing import CliRunner

pytest.importorskip("fastapi")

from dejavuu_build import schema as S
from dejavuu_build.runtime import load
from dejavuu_build.runtime.settings import DecodeSettings
from dejavuu_build.serve.bench import free_port, start_server
from dejavuu_build.serve.scheduler import Request, Result, Scheduler

NAME = "tiny-llama"
VARIANT = "int4-static"  # the default: its batched graph is the one the build writes
LONG = "the cat sat on the mat and then the dog sat on the log; " * 4  # > 64 positions


@pytest.fixture(scope="module")
def model(tiny_llama):
    return load(tiny_llama, variant=VARIANT)


def _one(sched, ids, n=12):
    done = threading.Event()
    out = []
    sched.submit(
        Request(
            ids,
            DecodeSettings(max_new_tokens=n, method="baseline"),
            lambda t: None,
            lambda r: (out.append(r), done.set()),
        )
    )
    assert done.wait(120)
    return out[0]


# ---------------------------------------------------------------- point 6: the batched graph is verified
def test_a_damaged_batched_graph_is_refused_not_trusted(tiny_llama):
    """The build's batched graph is checked against the manifest's sha256 like every other file the
    runtime reads: a truncated, flipped or lost one is refused with the command that rebuilds it
    (nothing is written at serve time)."""
    from conftest import clone_entry

    from dejavuu_build.errors import IntegrityError

    m = load(clone_entry(tiny_llama, "tiny-llama-damaged"), variant=VARIANT)
    path = m.folder / m.manifest.batched["file"]
    good = path.read_bytes()

    def flip():
        data = bytearray(good)
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))

    damages = {
        "truncated": lambda: path.write_bytes(good[: len(good) // 2]),
        "flipped": flip,
        "graph lost": path.unlink,
    }
    for what, damage in damages.items():
        damage()
        with pytest.raises(IntegrityError, match="rebuild it with"):
            Scheduler(m, max_batch=2).close()
            pytest.fail(f"{what}: served")
        path.write_bytes(good)
    s = Scheduler(m, max_batch=2)
    s.close()
    assert s.batched, s.why_sequential


def test_serving_writes_nothing_to_the_cache(model, cache_dir):
    """The batched graph comes with the entry: a server writes no graph (a read-only cache serves
    batched); only the runtime's machine-local calibrations may be added."""

    def files():
        return sorted(p for p in cache_dir.rglob("*") if S.RUNTIME_DIR not in p.parts)

    before = files()
    s = Scheduler(model, max_batch=2)
    try:
        assert s.batched, s.why_sequential
        r = _one(s, model.encode(LONG))
        assert isinstance(r, Result) and r.batched
        assert r.tokens == model.generate(model.encode(LONG), max_new_tokens=12).tokens
    finally:
        s.close()
    assert files() == before


def _clip_positions(m, rows=64, positions=S.GQA_POSITIONS):
    """The adversarial edit of an onnx model: positions past ``rows`` clipped to ``rows - 1``, so
    RoPE is wrong there (a start-up check at ~40 positions cannot see it). ``positions``: the
    graph's position input (the static batched graph's padded positions; position_ids in the
    rowwise one)."""
    from onnx import helper, numpy_helper

    g = m.graph
    hit = 0
    for n in g.node:
        for j, x in enumerate(n.input):
            if x == positions:
                n.input[j] = "position_ids/clipped"
                hit += 1
    assert hit, f"no {positions} input read"
    g.initializer.extend(
        [
            numpy_helper.from_array(np.array(0, np.int64), "clip.lo"),
            numpy_helper.from_array(np.array(rows - 1, np.int64), "clip.hi"),
        ]
    )
    g.node.insert(0, helper.make_node("Clip", [positions, "clip.lo", "clip.hi"], ["position_ids/clipped"]))
    return m


def test_a_batched_graph_wrong_past_64_fails_its_gate_and_is_not_served(tiny_llama, monkeypatch, caplog):
    """The build's gate decodes requests past 64 and 256 positions: a batched graph whose rows
    differ there (what the server's short start-up check cannot see) is recorded as failed, named
    in the summary, and never batched on: the server serves one request per forward."""
    from conftest import clone_entry

    from dejavuu_build.build.pipeline import quant_only
    from dejavuu_build.export.passes import serve_batch  # the static default's batched pass

    clone_entry(tiny_llama, "tiny-llama-badbatch")
    real = serve_batch.to_serve_batch
    monkeypatch.setattr(serve_batch, "to_serve_batch", lambda m, source="": _clip_positions(real(m, source)))
    with caplog.at_level(logging.INFO, logger="dejavuu"):
        b = quant_only("tiny-llama-badbatch", variants=("int4",), timing=False).manifest.batched
    assert b["variant"] == VARIANT and b["passed"] is False and b["gate"]["mismatches"] > 0, b
    assert "failed its gate" in caplog.text and "✗ (batched)" in caplog.text
    m = load("tiny-llama-badbatch", variant=VARIANT)
    assert m.manifest.variants[VARIANT].passed  # the variant itself is fine
    s = Scheduler(m, max_batch=2)
    s.close()
    assert not s.batched and "failed its gate at build" in s.why_sequential


# ---------------------------------------------------------------- point 7: availability
@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    proc, url = start_server(NAME, "--variant", VARIANT, log_path=str(tmp_path_factory.mktemp("srv") / "server.log"))
    yield url
    proc.terminate()
    proc.wait(30)


def test_a_huge_prompt_does_not_stall_the_server(server):
    big = "abc def " * (10 << 17)  # 10 MiB of text
    bodies = [
        ("/v1/completions", {"model": NAME, "prompt": big, "max_tokens": 4}),
        ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": big}], "max_tokens": 4}),
    ]
    answers = []

    def send(path, body):
        answers.append(httpx.post(server + path, json=body, timeout=600))

    senders = [threading.Thread(target=send, args=b) for b in bodies]
    for t in senders:
        t.start()
    time.sleep(0.5)
    t0 = time.perf_counter()
    assert httpx.get(server + "/health", timeout=10).json()["status"] == "ok"
    assert time.perf_counter() - t0 < 5.0
    for t in senders:
        t.join(600)
    assert [a.status_code for a in answers] == [400, 400]
    assert all(a.json()["error"]["code"] == "context_length_exceeded" for a in answers)
    ids = list(np.random.default_rng(0).integers(0, 200, 3_000_000).tolist())
    r = httpx.post(server + "/v1/completions", json={"model": NAME, "prompt": ids, "max_tokens": 4}, timeout=600)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize("depth", [1_000, 100_000])
def test_a_body_of_any_depth_is_a_400(server, depth):
    for path, field in (("/v1/completions", "prompt"), ("/v1/chat/completions", "messages")):
        content = f'{{"model": "{NAME}", "max_tokens": 2, "{field}": '.encode() + b"[" * depth + b"]" * depth + b"}"
        r = httpx.post(server + path, content=content, headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 400, (depth, r.status_code, r.text[:300])
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(server + "/health").json()["status"] == "ok"


# ---------------------------------------------------------------- points 9, 10: start-up errors
def test_a_taken_port_fails_before_it_says_serving(tiny_llama, cache_dir):
    port = free_port()
    with socket.socket() as held:
        held.bind(("127.0.0.1", port))
        held.listen()
        out = subprocess.run(
            [sys.executable, "-m", "dejavuu_build.build.cli", "serve", NAME, "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert out.returncode == 2, out.stderr[-2000:]
    assert "serving" not in out.stderr and "Traceback" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and f"127.0.0.1:{port}" in last and "--port" in last


def test_bad_serve_bounds_are_one_line():
    from dejavuu_build.cli import main

    for extra, needle in (
        (["--memory-tokens", "0"], "--memory-tokens"),
        (["--max-batch", "0"], "--max-batch"),
        (["--max-queue", "-1"], "--max-queue"),
        (["--ray", "--replicas", "0"], "--replicas"),
    ):
        r = CliRunner().invoke(main, ["serve", NAME, *extra])
        assert r.exit_code == 2, (extra, r.output)
        lines = r.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], (extra, r.output)
        assert "unexpected" not in r.output
