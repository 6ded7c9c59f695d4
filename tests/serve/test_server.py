"""The real server process (`dejavuu-build serve`) on a tiny random build, through the official
`openai` client: responses equal `Model.generate` token for token (chat, completions, streaming,
8 concurrent clients), a client that leaves mid-stream frees its slot, overload answers 429,
bad requests get OpenAI-shaped errors, and random bodies never take the server down."""

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

openai = pytest.importorskip("openai")

from dejavuu_build.runtime import load  # noqa: E402
from dejavuu_build.serve.bench import start_server  # noqa: E402

NAME = "tiny-llama"
VARIANT = "int4-static"  # the default: its batched graph is the one the build writes
PROMPTS = [
    "abcabcabcabc abcabc",
    "the cat sat on the mat. the cat sat on the",
    "1 2 3 1 2 3 1 2 3",
    "hello hello hello",
    "xyz xyz",
    "a b c d e f g a b c d e f g",
    "q",
    "mat mat mat cat",
]


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


@pytest.fixture(scope="module")
def model(tiny_llama):
    return load(tiny_llama, variant=VARIANT)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    proc, url = start_server(
        NAME,
        "--variant",
        VARIANT,
        "--method",
        "pld",
        "--max-batch",
        "8",
        log_path=str(tmp_path_factory.mktemp("srv") / "server.log"),
    )
    yield url
    proc.terminate()
    proc.wait(30)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=60)


def chat_ref(model, text, **kw):
    return model.generate([{"role": "user", "content": text}], **kw)


def test_models_health_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    h = httpx.get(server + "/health").json()
    assert h["status"] == "ok" and h["batched"] is True
    assert "dejavuu_queue_depth 0.0" in httpx.get(server + "/metrics").text


@pytest.mark.parametrize("temperature,seed", [(0.0, 0), (0.9, 123)])
def test_chat_equals_generate(model, client, temperature, seed):
    for text in PROMPTS[:3]:
        r = client.chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": text}],
            max_tokens=24,
            temperature=temperature,
            seed=seed,
            extra_body={"method": "suffix_decoding", "tree": True},
        )
        ref = chat_ref(model, text, max_new_tokens=24, temperature=temperature, seed=seed)
        assert r.choices[0].message.content == ref.text
        assert r.usage.completion_tokens == len(ref.tokens) and r.usage.prompt_tokens == ref.prompt_tokens
        assert r.choices[0].finish_reason == ("length" if ref.stop_reason == "max_new_tokens" else "stop")


def test_completions_and_streaming_equal_generate(model, client):
    text = PROMPTS[1]
    ref = model.generate(text, max_new_tokens=30)
    r = client.completions.create(model=NAME, prompt=text, max_tokens=30, temperature=0)
    assert r.choices[0].text == ref.text and r.usage.completion_tokens == len(ref.tokens)
    chunks = list(
        client.completions.create(
            model=NAME, prompt=text, max_tokens=30, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert chunks[-1].usage.completion_tokens == len(ref.tokens)
    chat = list(
        client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": text}], max_tokens=30, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chat) == chat_ref(model, text, max_new_tokens=30).text


def test_stop_strings(model, client):
    ref = model.generate(PROMPTS[1], max_new_tokens=40, stop=["t"])
    r = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=40, temperature=0, stop=["t"])
    assert r.choices[0].text == ref.text
    s = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=40, temperature=0, stop=["t"], stream=True)
    assert "".join(c.choices[0].text for c in s) == ref.text


def test_eight_concurrent_clients_equal_generate(model, server, client):
    before = metric(server, "dejavuu_shared_forwards_total")
    methods = ["baseline", "pld", "suffix_decoding", "asam", "auto", "lookahead", "token_recycling", "pld"]

    def one(i):
        kw = dict(max_tokens=40, temperature=0.7 if i % 3 == 0 else 0.0, seed=i)
        r = client.chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": PROMPTS[i]}],
            extra_body={"method": methods[i], "tree": i % 2 == 0},
            **kw,
        )
        return r.choices[0].message.content

    with ThreadPoolExecutor(8) as ex:
        got = list(ex.map(one, range(8)))
    for i, text in enumerate(got):
        ref = chat_ref(model, PROMPTS[i], max_new_tokens=40, temperature=0.7 if i % 3 == 0 else 0.0, seed=i)
        assert text == ref.text, i
    assert metric(server, "dejavuu_shared_forwards_total") > before


def test_disconnect_mid_stream_frees_the_request(server, client):
    cancelled = metric(server, 'dejavuu_requests_total{status="cancelled"}')
    with httpx.stream(
        "POST",
        server + "/v1/completions",
        timeout=30,
        json={
            "model": NAME,
            "prompt": PROMPTS[0],
            "max_tokens": 400,
            "stream": True,
            "method": "baseline",
            "temperature": 0,
        },
    ) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    deadline = time.time() + 20
    while time.time() < deadline and metric(server, 'dejavuu_requests_total{status="cancelled"}') == cancelled:
        time.sleep(0.1)
    assert metric(server, 'dejavuu_requests_total{status="cancelled"}') == cancelled + 1
    assert metric(server, "dejavuu_active_requests") == 0
    r = client.completions.create(model=NAME, prompt="abc", max_tokens=4, temperature=0)  # still serving
    assert r.usage.completion_tokens == 4


def test_overload_answers_429_and_recovers(model, tmp_path):
    proc, url = start_server(
        NAME, "--variant", VARIANT, "--max-batch", "1", "--max-queue", "1", log_path=str(tmp_path / "server.log")
    )
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)

        def one(_):
            try:
                c.completions.create(
                    model=NAME, prompt=PROMPTS[0], max_tokens=300, temperature=0, extra_body={"method": "baseline"}
                )
                return "ok"
            except openai.RateLimitError as e:
                assert e.status_code == 429 and e.body["code"] == "queue_full"
                return "429"

        with ThreadPoolExecutor(6) as ex:
            outcomes = list(ex.map(one, range(6)))
        assert "429" in outcomes and "ok" in outcomes
        r = c.completions.create(model=NAME, prompt="abc", max_tokens=3, temperature=0)
        assert r.usage.completion_tokens == 3
    finally:
        proc.terminate()
        proc.wait(30)


def test_bad_requests_get_openai_errors(server, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "x"}], extra_body={"method": "zzz"}
        )
    assert e.value.body["param"] == "method"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="x", max_tokens=10_000)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=NAME, prompt="x " * 600, max_tokens=5)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=NAME,
            messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}
            ],
        )
    r = httpx.post(server + "/v1/chat/completions", content=b"{not json")
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(server + "/v1/nothing").status_code == 404
    assert httpx.get(server + "/v1/nothing").json()["error"]["code"] == "not_found"


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=12), kids, max_size=4),
    max_leaves=12,
)
_fields = st.sampled_from(
    [
        "model",
        "messages",
        "prompt",
        "max_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "stream",
        "n",
        "method",
        "tree",
        "top_k",
        "stream_options",
        "logprobs",
        "memory_key",
    ]
)


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
    edits=st.dictionaries(_fields, _json, max_size=4),
    drop=st.lists(_fields, max_size=2),
    raw=st.one_of(st.none(), st.binary(max_size=64)),
)
def test_fuzz_bodies_never_break_the_server(server, path, edits, drop, raw):
    body = {"model": NAME, "max_tokens": 3, "temperature": 0}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})
    body.update(edits)
    for k in drop:
        body.pop(k, None)
    content = raw if raw is not None else json.dumps(body, allow_nan=True).encode()
    r = httpx.post(server + path, content=content, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code in (200, 400, 404), (r.status_code, r.text[:300])
    if r.status_code != 200:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_server_survives_the_fuzz(server):
    assert httpx.get(server + "/health").json()["status"] == "ok"
    assert metric(server, 'dejavuu_requests_total{status="error"}') == 0
