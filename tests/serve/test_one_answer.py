"""One model, one answer: `serve` without --variant decodes the manifest's default (what
`generate` and `load()` run) and batches it on the batched graph made from that same variant (the
static default's static batched flavour: layouts.static.StaticBatch over export.passes.serve_batch,
the single graph's row floor stripped), so a real HTTP client gets `generate`'s tokens, greedy and
seeded, chat and completions, plain and drafted, one at a time and side by side."""

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
from click.testing import CliRunner

openai = pytest.importorskip("openai")

from dejavuu_build import schema as S  # noqa: E402
from dejavuu_build.cli import main  # noqa: E402
from dejavuu_build.errors import GenerationError  # noqa: E402
from dejavuu_build.runtime import load  # noqa: E402
from dejavuu_build.runtime.job import STEP_ROOM  # noqa: E402
from dejavuu_build.serve.bench import start_server  # noqa: E402

NAME = "tiny-llama"
PROMPTS = ["the cat sat on the mat. the cat sat on the", "1 2 3 1 2 3 1 2 3", "q", "abc abc abc"]


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    m = S.read_manifest(tiny_llama)
    # the case this test is about: the batched graph is the default's own, and the default is the
    # static layout a timed build keeps (untimed builds pick it too: build.default), not rowwise
    assert S.split_variant(m.default_variant)[1] == S.KV_STATIC, m.default_variant
    assert m.batched["variant"] == m.default_variant and m.batched["layout"] == S.KV_STATIC
    proc, url = start_server(NAME, "--method", "pld", log_path=str(tmp_path_factory.mktemp("one") / "server.log"))
    yield url
    proc.terminate()
    proc.wait(30)


@pytest.mark.parametrize("temperature,seed", [(0.0, 0), (0.9, 7)])
def test_the_server_gives_generates_answer(tiny_llama, server, temperature, seed):
    import httpx

    model = load(tiny_llama)
    assert model.variant == S.read_manifest(tiny_llama).default_variant
    assert model.contract.kv_layout == S.KV_STATIC  # the Python API decodes the static default too
    health = httpx.get(server + "/health").json()
    assert health["batched"] is True  # the default's own batched graph: batched and the same bits
    client = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=60)
    kw = dict(temperature=temperature, seed=seed)
    for text in PROMPTS:
        msgs = [{"role": "user", "content": text}]
        ref = model.generate(msgs, max_new_tokens=12, **kw)
        got = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=12, **kw)
        assert got.choices[0].message.content == ref.text, text
        plain = model.generate(text, max_new_tokens=12, method="baseline", **kw)
        comp = client.completions.create(model=NAME, prompt=text, max_tokens=12, **kw)
        assert comp.choices[0].text == plain.text, text
        # `dejavuu-build generate` (the CLI) prints the same text
        args = ["--max-new-tokens", "12", "--temperature", str(temperature), "--seed", str(seed), "--json"]
        r = CliRunner().invoke(main, ["generate", NAME, text, *args])
        assert r.exit_code == 0, r.output
        out = json.loads(r.output[r.output.index("{") :])
        assert out["variant"] == model.variant and out["text"] == comp.choices[0].text, text


def test_requests_side_by_side_give_generates_answer(tiny_llama, server):
    """Several clients at once, greedy and seeded side by side: their requests share forwards of
    the batched graph (the server's /metrics counts them) and each gets the text `generate` gives
    it alone."""
    import httpx

    model = load(tiny_llama)
    client = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=120)
    texts = [p * k for k in (1, 3) for p in PROMPTS]  # different prompt lengths, so different pasts
    kws = [dict(temperature=0.0 if i % 2 else 0.9, seed=i) for i in range(len(texts))]

    def ask(i):
        return client.completions.create(model=NAME, prompt=texts[i], max_tokens=40, **kws[i]).choices[0].text

    shared = _shared_forwards(httpx.get(server + "/metrics").text)
    with ThreadPoolExecutor(len(texts)) as pool:
        got = list(pool.map(ask, range(len(texts))))
    for text, kw, g in zip(texts, kws, got):
        assert g == model.generate(text, max_new_tokens=40, method="baseline", **kw).text, (text, kw)
    assert _shared_forwards(httpx.get(server + "/metrics").text) > shared  # really side by side


def test_the_server_takes_what_generate_takes_at_the_cache_end(tiny_llama, server):
    """The server's context limit is generate's (runtime.job.STEP_ROOM): a prompt that fills the KV
    cache to its last usable position decodes to generate's tokens, side by side with a request
    verifying long chains (whose padded steps it has no room for: layouts.static.StaticBatch runs it
    in a narrower forward); one token more is refused by both."""
    model = load(tiny_llama)
    cap = model.decoder.capacity
    n = 6
    near = model.encode("the cat sat on the mat. " * 200)[: cap - n - STEP_ROOM]
    wide = PROMPTS[3] * 6
    client = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=120)
    with ThreadPoolExecutor(2) as pool:
        f_wide = pool.submit(client.completions.create, model=NAME, prompt=wide, max_tokens=120, temperature=0)
        f_near = pool.submit(client.completions.create, model=NAME, prompt=near, max_tokens=n, temperature=0)
        got_near, got_wide = f_near.result(), f_wide.result()
    assert got_near.choices[0].text == model.generate(near, max_new_tokens=n, method="baseline").text
    assert got_wide.choices[0].text == model.generate(wide, max_new_tokens=120, method="baseline").text
    over = near + near[-1:]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt=over, max_tokens=n, temperature=0)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(GenerationError, match="does not fit"):
        model.generate(over, max_new_tokens=n, method="baseline")


def _shared_forwards(metrics: str) -> float:
    found = re.search(r"^dejavuu_shared_forwards(?:_total)?\s+(\S+)$", metrics, re.M)
    assert found, metrics[:500]
    return float(found.group(1))


def test_a_batched_graph_of_another_variant_is_not_batched(tiny_llama):
    """open_batch refuses the default's (static) graph for the rowwise twin with one line naming
    --variant, and opens it for the default."""
    from dejavuu_build.layouts.static import StaticBatch
    from dejavuu_build.serve.batch import BatchUnavailable, open_batch

    m = S.read_manifest(tiny_llama)
    with pytest.raises(BatchUnavailable, match=f"--variant {m.batched['variant']}"):
        open_batch(load(tiny_llama, variant="int4-rowwise"), 4)
    assert isinstance(open_batch(load(tiny_llama), 4), StaticBatch)
