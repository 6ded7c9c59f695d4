"""Stop strings (runtime.stops), in every path that ends text at one: a stop string split between
two decoded chunks is cut, and none of it is sent, by the engine's stop (generate), the stream, and
the server's streamed and whole answers."""

import json

import pytest

from dejavuu_build.runtime import load
from dejavuu_build.runtime.stops import StopStream, TextStream, cut, stop_fn

PROMPT = "the cat sat on the mat. the cat sat on the"
KW = dict(max_new_tokens=40, method="pld", temperature=1.0, seed=3)  # seeded sampling: varied text


class _Pieces:
    """A tokenizer whose tokens are several characters: "hel" "lo w" "or" "ld" "!"."""

    VOCAB = ["hel", "lo w", "or", "ld", "!"]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.VOCAB[i] for i in ids)


def test_stop_stream_holds_back_a_stop_string_split_between_pieces():
    s = StopStream(["world"])
    assert [s.push("hello w"), s.push("orld! bye")] == ["hel", "lo "] and s.finish() == ""
    s = StopStream(["world"])
    assert s.push("hello w") + s.push("ord") + s.finish() == "hello word"  # held back, then released
    assert cut("hello world", ["xyz", "o w", "wor"]) == "hell" and cut("abc", ["d"]) == "abc"


def test_text_stream_and_the_engines_stop_cut_a_stop_string_split_between_steps():
    ts = TextStream(_Pieces(), ["world"])
    assert ts.push([0, 1]) + ts.push([2, 3, 4]) + ts.finish() == "hello "  # "w" | "orld" in two steps
    should_stop = stop_fn(_Pieces(), ["world"])
    assert should_stop([0, 1]) is None
    assert should_stop([0, 1, 2, 3, 4]) == 4  # the ids up to the one completing "world"


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return load(tiny_llama, variant="int4")


@pytest.fixture(scope="module")
def case(tiny):
    """(the text without a stop string, a stop string straddling two steps' chunks, where it starts,
    the tokens up to the one that completes it)."""
    chunks: list[list[int]] = []
    full = tiny.generate(PROMPT, on_tokens=chunks.append, **KW)
    text, dec = full.text, tiny.tokenizer.decode
    ends = [len(dec(full.tokens[:n])) for n in range(1, len(full.tokens) + 1)]
    bounds, n = [], 0
    for c in chunks[:-1]:  # character offsets where one step's text ends
        n += len(c)
        bounds.append(ends[n - 1])
    for b in bounds:
        stop = text[b - 2 : b + 2]
        if b >= 4 and len(stop) == 4 and text.find(stop) == b - 2:
            keep = next(k for k in range(1, len(full.tokens) + 1) if stop in dec(full.tokens[:k]))
            return text, stop, b - 2, full.tokens[:keep]
    pytest.fail(f"no stop string straddles two chunks of {text!r}")


def test_generate_cuts_a_stop_string_split_between_steps(tiny, case):
    text, stop, at, tokens = case
    r = tiny.generate(PROMPT, stop=[stop], **KW)
    assert r.stop_reason == "stop_string" and r.text == text[:at] != "" and r.tokens == tokens


def test_stream_cuts_a_stop_string_split_between_steps(tiny, case):
    text, stop, at, _ = case
    pieces = list(tiny.stream(PROMPT, stop=[stop], **KW))
    assert "".join(pieces) == text[:at]


def test_server_cuts_a_stop_string_split_between_steps(tiny, case):
    """The app in process (FastAPI's test client, the scheduler one request at a time): the
    streamed pieces and the whole answer both end before the stop string."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from dejavuu_build.runtime.settings import DecodeSettings
    from dejavuu_build.serve.app import create_app
    from dejavuu_build.serve.scheduler import Scheduler

    text, stop, at, _ = case
    sched = Scheduler(tiny, max_batch=1, batch=False)
    try:
        client = TestClient(create_app(tiny, sched, served_name="tiny", defaults=DecodeSettings(method="pld")))
        body = {
            "model": "tiny",
            "prompt": PROMPT,
            "max_tokens": KW["max_new_tokens"],
            "temperature": 1.0,
            "seed": KW["seed"],
            "stop": [stop],
        }
        whole = client.post("/v1/completions", json=body).json()
        assert whole["choices"][0]["text"] == text[:at] and whole["choices"][0]["finish_reason"] == "stop"
        pieces = []
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    pieces += [c["text"] for c in json.loads(line[6:])["choices"] if c["text"]]
        assert "".join(pieces) == text[:at]
    finally:
        sched.close()
