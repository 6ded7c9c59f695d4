"""Issue 25 (trust, round two), the server: its batched graph under <cache>/.serve/ is checked on
every start and rebuilt when wrong (truncated, edited, a killed writer's temp file), an
unwritable cache serves one request at a time with one warning, a large prompt does not stall
the event loop, a body of any depth is a 400, a taken port fails before "serving ...", and bad
bounds are one line. The server runs as a real process where the existing tests do so."""

import errno
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

from dejavuu_build.runtime import load
from dejavuu_build.serve import graph
from dejavuu_build.serve.bench import free_port, start_server
from dejavuu_build.serve.scheduler import Params, Request, Result, Scheduler

NAME = "tiny-llama"
VARIANT = "int4-static"
LONG = "the cat sat on the mat and then the dog sat on the log; " * 4  # > 64 positions


@pytest.fixture(scope="module")
def model(tiny_llama):
    return load(tiny_llama, variant=VARIANT)


def _graph_path(model, cache):
    return graph.batched_path(model.folder / model.manifest.variants[model.variant].file, cache)


def _temps(folder):
    return sorted(p.name for p in folder.iterdir() if graph.TMP_MARK in p.name)


def _one(sched, ids, n=12):
    done = threading.Event()
    out = []
    sched.submit(
        Request(ids, Params(max_new_tokens=n, method="baseline"), lambda t: None, lambda r: (out.append(r), done.set()))
    )
    assert done.wait(120)
    return out[0]


# ---------------------------------------------------------------- point 6: the batched graph is verified
def test_a_damaged_batched_graph_is_rebuilt_not_trusted(model, tmp_path):
    s = Scheduler(model, max_batch=2, cache=tmp_path)
    s.close()
    assert s.batched, s.why_sequential
    path = _graph_path(model, tmp_path / ".serve")
    good = path.read_bytes()

    def flip():
        data = bytearray(good)
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))

    damages = {
        "truncated": lambda: path.write_bytes(good[: len(good) // 2]),
        "flipped": flip,
        "record lost": lambda: (path.parent / graph.BATCHED_RECORD_FILE).unlink(),
        "graph lost": path.unlink,
        "killed writer's temp": lambda: (path.parent / f"{path.name}{graph.TMP_MARK}99999").write_bytes(b"x" * 4096),
    }
    alone = model.generate(model.encode(LONG), max_new_tokens=12).tokens
    for what, damage in damages.items():
        damage()
        s = Scheduler(model, max_batch=2, cache=tmp_path)
        try:
            assert s.batched, (what, s.why_sequential)
            r = _one(s, model.encode(LONG))
            assert isinstance(r, Result) and r.batched and r.tokens == alone, what
        finally:
            s.close()
        assert path.read_bytes() == good, what
        assert _temps(path.parent) == [], what


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records = []

    def emit(self, record):
        self.records.append(record)


def test_an_unwritable_cache_serves_one_request_at_a_time_with_one_warning(model, tmp_path, monkeypatch):
    import onnx

    real_save = onnx.save

    def full_disk(m, f, *a, **kw):
        with open(f, "wb") as fh:
            fh.write(b"\0" * 100_000)  # half a file, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(onnx, "save", full_disk)
    alone = model.generate(model.encode(LONG), max_new_tokens=12).tokens
    seen = _Records()
    logging.getLogger("dejavuu").addHandler(seen)  # the package logger may not propagate (setup_logging)
    try:
        s = Scheduler(model, max_batch=2, cache=tmp_path / "full")
        try:
            assert not s.batched and "No space left on device" in s.why_sequential
            r = _one(s, model.encode(LONG))
            assert isinstance(r, Result) and r.tokens == alone and not r.batched
        finally:
            s.close()
    finally:
        logging.getLogger("dejavuu").removeHandler(seen)
    warnings = seen.records
    assert len(warnings) == 1 and "one request at a time" in warnings[0].getMessage(), warnings
    folder = _graph_path(model, tmp_path / "full" / ".serve").parent
    assert _temps(folder) == [] and not (folder / "decoder_batched.onnx").exists()
    monkeypatch.setattr(onnx, "save", real_save)

    # read-only: nothing can be created; with a good graph already there it still serves batched
    from pathlib import Path

    real_mkdir = Path.mkdir

    def read_only(self, *a, **kw):
        if str(self).startswith(str(tmp_path)):
            raise OSError(errno.EROFS, "Read-only file system")
        return real_mkdir(self, *a, **kw)

    monkeypatch.setattr(Path, "mkdir", read_only)
    s = Scheduler(model, max_batch=2, cache=tmp_path / "ro")
    s.close()
    assert not s.batched and "Read-only file system" in s.why_sequential
    monkeypatch.setattr(Path, "mkdir", real_mkdir)
    Scheduler(model, max_batch=2, cache=tmp_path / "ro").close()  # written while writable
    monkeypatch.setattr(Path, "mkdir", read_only)
    s = Scheduler(model, max_batch=2, cache=tmp_path / "ro")
    s.close()
    assert s.batched, s.why_sequential


def _zero_rope_past(path, rows=64):
    """The adversarial edit: every GroupQueryAttention's cos/sin rows past ``rows`` zeroed (a
    start-up check at ~40 positions cannot see it)."""
    import onnx
    from onnx import numpy_helper

    m = onnx.load(str(path))
    names = {i for n in m.graph.node if n.op_type == "GroupQueryAttention" for i in n.input[7:9] if i}
    hit = 0
    for init in m.graph.initializer:
        if init.name in names:
            a = numpy_helper.to_array(init).copy()
            a[rows:] = 0
            init.CopyFrom(numpy_helper.from_array(a, init.name))
            hit += 1
    assert hit, "no cos/sin caches found"
    onnx.save(m, str(path))


def test_a_tampered_batched_graph_is_not_served(model, tmp_path):
    """The start-up check compares ~40 positions; the batched rows must equal the single decoder's
    bit for bit past 64 too, which only a graph checked against its record guarantees."""
    from dejavuu_build.runtime.job import Rows

    src = model.folder / model.manifest.variants[model.variant].file
    path = graph.batched_path(src, tmp_path / ".serve")
    graph.batched_graph(src, path)
    _zero_rope_past(path)
    ids = np.random.default_rng(0).integers(0, model.contract.vocab_size, 100).tolist()
    kv = model.decoder.new_cache()
    try:
        want = model.decoder.forward(ids, None, kv)[0].copy()
    finally:
        kv.release()
    s = Scheduler(model, max_batch=2, cache=tmp_path)
    try:
        assert s.batched, s.why_sequential
        slot = s.batch.acquire(None)
        ((got, _),) = s.batch.forward(slot, [Rows(ids, None)])
        s.batch.release(slot)
    finally:
        s.close()
    assert np.array_equal(got[:64], want[:64])
    assert np.array_equal(got, want), "rows past 64 differ: the tampered graph was served"


def test_serve_rebuilds_a_tampered_batched_graph(model, cache_dir, tmp_path):
    src = model.folder / model.manifest.variants[model.variant].file
    path = graph.batched_path(src, cache_dir / ".serve")
    if not path.is_file():
        graph.batched_graph(src, path)
    good = path.read_bytes()
    _zero_rope_past(path)
    assert path.read_bytes() != good
    proc, url = start_server(NAME, "--variant", VARIANT, "--method", "baseline", log_path=str(tmp_path / "server.log"))
    try:
        assert httpx.get(url + "/health").json()["batched"] is True
        r = httpx.post(
            url + "/v1/completions",
            timeout=120,
            json={"model": NAME, "prompt": LONG, "max_tokens": 24, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == model.generate(LONG, max_new_tokens=24).text
    finally:
        proc.terminate()
        proc.wait(30)
    assert path.read_bytes() == good


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
