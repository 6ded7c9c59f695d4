"""One model, one answer: `serve` without --variant decodes the manifest's default (what
`generate` and `load()` run), so a real HTTP client gets `generate`'s tokens, greedy, chat and
completions, plain and drafted; it batches only a batched graph of that same variant."""

import json

import pytest
from click.testing import CliRunner

openai = pytest.importorskip("openai")

from dejavuu_build import schema as S  # noqa: E402
from dejavuu_build.cli import main  # noqa: E402
from dejavuu_build.runtime import load  # noqa: E402
from dejavuu_build.serve.bench import start_server  # noqa: E402

NAME = "tiny-llama"
PROMPTS = ["the cat sat on the mat. the cat sat on the", "1 2 3 1 2 3 1 2 3", "q", "abc abc abc"]


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    m = S.read_manifest(tiny_llama)
    # the case this test is about: the default is not the variant the batched graph was made from
    assert m.batched.get("variant") and m.batched["variant"] != m.default_variant
    proc, url = start_server(NAME, "--method", "pld", log_path=str(tmp_path_factory.mktemp("one") / "server.log"))
    yield url
    proc.terminate()
    proc.wait(30)


def test_the_server_gives_generates_answer(tiny_llama, server):
    import httpx

    model = load(tiny_llama)
    assert model.variant == S.read_manifest(tiny_llama).default_variant
    health = httpx.get(server + "/health").json()
    assert health["batched"] is False  # the static graph's rows are other bits: not batched
    client = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=60)
    for text in PROMPTS:
        msgs = [{"role": "user", "content": text}]
        ref = model.generate(msgs, max_new_tokens=12, temperature=0.0)
        got = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=12, temperature=0.0)
        assert got.choices[0].message.content == ref.text
        plain = model.generate(text, max_new_tokens=12, temperature=0.0, method="baseline")
        comp = client.completions.create(model=NAME, prompt=text, max_tokens=12, temperature=0.0)
        assert comp.choices[0].text == plain.text
        # `dejavuu-build generate` (the CLI) prints the same text
        r = CliRunner().invoke(main, ["generate", NAME, text, "--max-new-tokens", "12", "--json"])
        assert r.exit_code == 0, r.output
        assert json.loads(r.output[r.output.index("{") :])["text"] == comp.choices[0].text


def test_a_batched_graph_of_another_variant_is_not_batched(tiny_llama):
    """open_batch refuses the static graph for a rowwise model with one line naming --variant."""
    from dejavuu_build.serve.batch import BatchUnavailable, open_batch

    m = S.read_manifest(tiny_llama)
    other = next(v for v in m.variants if v != m.batched["variant"] and S.split_variant(v)[1] == S.KV_ROWWISE)
    with pytest.raises(BatchUnavailable, match=f"--variant {m.batched['variant']}"):
        open_batch(load(tiny_llama, variant=other), 4)
    assert open_batch(load(tiny_llama, variant=m.batched["variant"]), 4) is not None
