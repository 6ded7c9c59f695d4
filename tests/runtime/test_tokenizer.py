"""The runtime tokenizer: chat templates run bounded in time and size (item 8), and text is
decoded incrementally, a short window per step (item 14)."""

import shutil
import threading
import time

import pytest

from dejavuu_build.errors import GenerationError
from dejavuu_build.runtime import tokenizer as T


def _tokenizer_with(tmp_path, tiny_llama, template: str) -> T.TextTokenizer:
    d = tmp_path / "tok"
    d.mkdir(exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_llama / f, d / f)
    (d / "chat_template.jinja").write_text(template)
    return T.TextTokenizer(d)


def _bounded(fn, seconds):
    """Run fn in a thread; (finished in time, its result or exception)."""
    out = []

    def run():
        try:
            out.append(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    return (not t.is_alive()), (out[0] if out else None)


HOSTILE = {
    "nested loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "huge repeat": "{{ 'x' * 300000000 }}",
    "list repeat": "{{ ([1] * 100000) * 100000 }}",
    "output piling up": "{% for i in range(100000) %}{{ 'x' * 90000 }}{% endfor %}",
    "doubling by ~": "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}{{ ns.s|length }}",
    "doubling by +": "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}"
    "{% endfor %}{{ ns.s|length }}",
    "center": "{{ 'x'|center(300000000) }}",
    "str method": "{{ 'x'.ljust(300000000) }}",
    "percent width": "{{ '%0300000000d' % 1 }}",
    "format width": "{{ '{:>300000000}'.format(1) }}",
    "format filter": "{{ '%300000000s'|format(1) }}",
    "replace": "{{ ('x' * 100000)|replace('x', 'y' * 100000) }}",
    "join": "{{ (['y' * 100000] * 10000)|join }}",
    "big power": "{{ 7 ** 100000000 }}",
    "recursion": "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_template_is_a_clear_error_in_bounded_time(tmp_path, tiny_llama, name):
    tok = _tokenizer_with(tmp_path, tiny_llama, HOSTILE[name])
    t0 = time.perf_counter()
    done, out = _bounded(lambda: tok.apply_chat_template([{"role": "user", "content": "hi"}]), T.TEMPLATE_SECONDS + 10)
    assert done, f"{name}: still rendering after {T.TEMPLATE_SECONDS + 10}s"
    assert isinstance(out, GenerationError), (name, type(out), str(out)[:200])
    assert "chat template" in str(out)
    assert time.perf_counter() - t0 < T.TEMPLATE_SECONDS + 10


def test_an_ordinary_template_still_renders(tmp_path, tiny_llama):
    from tiny import CHAT_TEMPLATE

    tok = _tokenizer_with(tmp_path, tiny_llama, CHAT_TEMPLATE)
    out = tok.apply_chat_template([{"role": "user", "content": "hi " * 1000}])
    assert out.startswith("<|im_start|>user\nhi hi") and out.endswith("<|im_start|>assistant\n")


def test_a_hostile_template_through_the_cli_is_one_line(tmp_path, tiny_llama, cache_dir):
    from click.testing import CliRunner

    from dejavuu_build.cli import main

    d = tmp_path / "entry"
    shutil.copytree(tiny_llama, d)
    (d / "chat_template.jinja").write_text(HOSTILE["huge repeat"])
    (d / "manifest.json").unlink()  # a third-party folder (neither our manifest nor our contract):
    (d / "contract.json").unlink()  # its template is run (sandboxed)
    r = CliRunner().invoke(main, ["generate", str(d / "decoder_fp32.onnx"), "--chat", "hi", "--max-new-tokens", "2"])
    assert r.exit_code == 2 and r.output.strip().splitlines()[-1].startswith("error: chat template"), r.output


# ---------------------------------------------------------------- item 14: incremental decoding
def _byte_level(tmp_path):
    """A small byte-level BPE (multi-byte characters split across tokens), trained offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    corpus = ["héllo wörld, naïve café", "日本語のテキスト", "emoji 🙂🙃 and ünïcödé", "plain ascii text here"] * 20
    tk.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    )
    d = tmp_path / "bl"
    d.mkdir()
    tk.save(str(d / "tokenizer.json"))
    return T.TextTokenizer(d)


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_incremental_pieces_join_to_the_full_decode(tmp_path, chunk):
    tok = _byte_level(tmp_path)
    text = "héllo 日本語 🙂 wörld, café 🙃 end"
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode(ids[:i]) for i in range(1, len(ids)))  # characters do split
    dec = T.IncrementalDecoder(tok)
    pieces = [dec.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)] + [dec.flush()]
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)


def test_each_push_decodes_a_short_window(tmp_path):
    tok = _byte_level(tmp_path)
    ids = tok.encode("plain ascii text here " * 200)
    seen = []
    real = tok.tok

    class Counting:
        def __getattr__(self, k):
            return getattr(real, k)

        def decode(self, ids, **kw):
            seen.append(len(ids))
            return real.decode(ids, **kw)

    tok.tok = Counting()
    dec = T.IncrementalDecoder(tok)
    for t in ids:
        dec.push([t])
    assert max(seen) <= 8 and sum(seen) <= 8 * len(ids)
