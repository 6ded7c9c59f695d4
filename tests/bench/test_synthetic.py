"""bench.synthetic: a random-weight Llama GGUF of the asked shapes that our source reader takes."""

import gguf
import pytest

from dejavuu_build.bench.synthetic import LlamaShapes, main, write_llama_gguf
from dejavuu_build.build import sources
from tests.build.test_sources import _tiny_gguf

TINY = LlamaShapes(hidden=64, layers=2, heads=4, kv_heads=2, ffn=96, context=128)


@pytest.fixture
def template(tmp_path):
    """A one-layer GGUF with a small byte-level BPE tokenizer: the section the synthetic file copies."""
    return _tiny_gguf(tmp_path / "template.gguf", add_bos=False)


def test_shapes_types_and_tokenizer(tmp_path, template):
    rec = write_llama_gguf(tmp_path / "s.gguf", TINY, template, seed=1)
    src_fields = gguf.GGUFReader(str(template)).fields
    r = gguf.GGUFReader(rec["path"])
    vocab = len(src_fields["tokenizer.ggml.tokens"].data)
    assert rec["vocab"] == vocab and rec["parameters"] == TINY.parameters(vocab)
    assert r.fields["llama.embedding_length"].contents() == 64
    assert r.fields["llama.block_count"].contents() == 2
    assert r.fields["llama.attention.head_count"].contents() == 4
    assert r.fields["llama.attention.head_count_kv"].contents() == 2
    assert r.fields["llama.feed_forward_length"].contents() == 96
    assert r.fields["llama.context_length"].contents() == 128
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"):
        assert r.fields[key].contents() == src_fields[key].contents()
    assert r.fields["tokenizer.ggml.eos_token_id"].contents() == 2
    tensors = {t.name: t for t in r.tensors}
    want = TINY.tensors(vocab)
    assert set(tensors) == set(want) and "output.weight" not in tensors  # tied, as SmolLM2
    for name, shape in want.items():
        t = tensors[name]
        assert tuple(int(d) for d in reversed(t.shape)) == shape, name  # gguf lists dims innermost first
        kind = "F32" if len(shape) == 1 else "Q8_0" if name == "token_embd.weight" else "Q4_1"
        assert t.tensor_type.name == kind, name
    q = gguf.quants.dequantize(tensors["blk.0.ffn_down.weight"].data, gguf.GGMLQuantizationType.Q4_1)
    assert q.shape == (64, 96) and 0.01 < float(q.std()) < 0.03  # N(0, 0.02), carried through the blocks
    # the same seed writes the same bytes; another seed other weights
    again = write_llama_gguf(tmp_path / "t.gguf", TINY, template, seed=1)
    other = write_llama_gguf(tmp_path / "u.gguf", TINY, template, seed=2)
    b = (tmp_path / "s.gguf").read_bytes()
    assert b == (tmp_path / "t.gguf").read_bytes() and again["bytes"] == len(b)
    assert b != (tmp_path / "u.gguf").read_bytes() and other["bytes"] == len(b)


def test_our_source_reader_takes_it(tmp_path, template):
    path = tmp_path / "synth.gguf"
    write_llama_gguf(path, TINY, template)
    src = sources.resolve(str(path))
    assert src.kind == "gguf"
    model, tok, _, recipe = sources.load_model_and_tokenizer(src)
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (64, 2, 4, 2)
    assert cfg.intermediate_size == 96 and cfg.vocab_size == len(tok)
    assert recipe.name == "llama"
    assert tok.decode(tok.encode("hello world")) == "hello world"


def test_bad_shapes_and_cli(tmp_path, template, capsys):
    with pytest.raises(ValueError, match="do not divide"):
        write_llama_gguf(tmp_path / "x.gguf", LlamaShapes(hidden=64, heads=3, kv_heads=1, ffn=96), template)
    with pytest.raises(ValueError, match="multiples of 32"):
        write_llama_gguf(tmp_path / "x.gguf", LlamaShapes(hidden=64, heads=4, kv_heads=2, ffn=100), template)
    assert not (tmp_path / "x.gguf").exists()
    args = ["--hidden", "64", "--layers", "1", "--heads", "4", "--kv-heads", "2", "--ffn", "96", "--context", "64"]
    assert main(["--out", str(tmp_path / "c.gguf"), "--template", str(template), *args]) == 0
    assert '"parameters"' in capsys.readouterr().out
    assert gguf.GGUFReader(str(tmp_path / "c.gguf")).fields["llama.block_count"].contents() == 1
    # a bad shape or no template: one line and exit 2, no traceback
    bad = ["--hidden", "64", "--heads", "3", "--kv-heads", "1"]
    assert main(["--out", str(tmp_path / "d.gguf"), "--template", str(template), *bad]) == 2
    assert capsys.readouterr().err.strip() == "error: hidden 64 / heads 3 / kv heads 1 do not divide"
    assert main(["--out", str(tmp_path / "d.gguf"), "--template", str(tmp_path / "none.gguf"), *args]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_size_row_projects_from_row_costs():
    from dejavuu_build.bench.synthetic import row_cost, size_row

    assert row_cost([(2, 1.5), (4, 2.0)], 1) == 1.0
    assert row_cost([(2, 1.5), (4, 2.0)], 3) == pytest.approx(1.75)
    assert row_cost([(2, 1.5), (4, 2.0)], 6) == pytest.approx(2.5)  # past the last point: its slope
    base = {"context": 256, "rows": 1, "x_plain_forward": None, "rows_mean": None}
    sweep = {
        "model_variant": "int4-static",
        "rows": [
            {**base, "system": "baseline", "decode_tok_s": 10.0, "x_genai": 0.8},
            {**base, "system": "genai", "decode_tok_s": 12.5, "x_genai": 1.0},
            *(
                {**base, "system": "verify", "rows": n, "rows_mean": n, "x_plain_forward": 1 + 0.1 * (n - 1)}
                for n in (2, 4, 8)
            ),
        ],
    }
    r = size_row(sweep, tokens_per_step=1.5, rows_per_step=3.0)
    assert r["extra_row"] == pytest.approx(0.1) and r["verify"] == pytest.approx({2: 1.1, 4: 1.3, 8: 1.7})
    assert r["projected_speedup"] == pytest.approx(1.5 / 1.2)
    assert r["projected_x_genai"] == pytest.approx(0.8 * 1.5 / 1.2)
    assert (r["ours_tok_s"], r["genai_tok_s"], r["variant"]) == (10.0, 12.5, "int4-static")


def test_size_row_on_a_padded_decoder():
    """A padded decoder's plain step runs 2 rows: costs are anchored there, not at one row."""
    from dejavuu_build.bench.synthetic import row_cost, size_row

    assert row_cost([(2, 1.0), (4, 1.2)], 1.5, plain_rows=2) == 1.0
    assert row_cost([(2, 1.0), (4, 1.2)], 3, plain_rows=2) == pytest.approx(1.1)
    base = {"context": 256, "x_plain_forward": None, "rows_mean": None, "x_genai": None}
    sweep = {
        "rows": [
            {**base, "system": "baseline", "rows": 2, "decode_tok_s": 4.0, "x_genai": 0.5},
            *(
                {**base, "system": "verify", "rows": n, "rows_mean": n, "x_plain_forward": 1 + 0.05 * (n - 2)}
                for n in (2, 4, 8)
            ),
        ]
    }
    r = size_row(sweep, tokens_per_step=1.5, rows_per_step=4.0)
    assert r["plain_rows"] == 2 and r["extra_row"] == pytest.approx(0.05) and r["genai_tok_s"] is None
    assert r["projected_speedup"] == pytest.approx(1.5 / 1.1)


def test_vocabulary_cut_keeps_a_working_bpe(tmp_path, template):
    """--vocab N: the template's first N tokens and only the merges among them; the cut tokenizer
    still spells every text (in shorter pieces), and the model's tables are N rows."""
    rec = write_llama_gguf(tmp_path / "cut.gguf", TINY, template, vocab=18)
    f = gguf.GGUFReader(rec["path"]).fields
    tokens = f["tokenizer.ggml.tokens"].contents()
    assert rec["vocab"] == 18 and len(tokens) == 18 and len(f["tokenizer.ggml.token_type"].contents()) == 18
    assert f["tokenizer.ggml.merges"].contents() == ["h e", "l l", "he ll", "hell o"]  # "Ġ w"... made cut tokens
    assert rec["parameters"] == TINY.parameters(18)
    model, tok, _, _ = sources.load_model_and_tokenizer(sources.resolve(rec["path"]))
    assert model.config.vocab_size == len(tok) == 18
    ids = tok.encode("hello world")
    assert max(ids) < 18 and tok.decode(ids) == "hello world"
    with pytest.raises(ValueError, match="cannot make a vocabulary of 99"):
        write_llama_gguf(tmp_path / "big.gguf", TINY, template, vocab=99)


def test_vocabulary_cut_refuses_what_it_cannot_cut(template):
    from dejavuu_build.bench.synthetic import _tokenizer_fields, cut_vocabulary

    fields = _tokenizer_fields(template)
    assert cut_vocabulary(fields, 21) is fields  # the whole vocabulary: unchanged
    with pytest.raises(ValueError, match="special token id"):
        cut_vocabulary(fields, 2)  # EOS is id 2
    spm = [(k, "llama" if k == "tokenizer.ggml.model" else v, t, s) for k, v, t, s in fields]
    with pytest.raises(ValueError, match="only a BPE"):
        cut_vocabulary(spm, 10)


def test_speed_build_writes_only_what_a_speed_row_times(tmp_path, template, cache_dir):
    """The speed-only build: int4 and its static flavour (the default), no fp32 graph, no torch
    references, every variant marked speed_only; the runtime loads it and decodes; a full build of
    the same name is never replaced by one."""
    from dejavuu_build import schema as S
    from dejavuu_build.bench.synthetic import SPEED_ONLY, speed_build
    from dejavuu_build.errors import CacheError, ExportError
    from dejavuu_build.kernels import attn, q41
    from dejavuu_build.runtime import load
    from dejavuu_build.runtime.model import read_checked_manifest
    from dejavuu_build.runtime.session import graph_domains

    gguf_path = tmp_path / "s.gguf"
    write_llama_gguf(gguf_path, LlamaShapes(hidden=64, layers=1, heads=4, kv_heads=2, ffn=96, context=128), template)
    folder = speed_build(gguf_path, "synth-speed", threads=1)
    m = read_checked_manifest(folder)
    assert set(m.variants) == {"int4", "int4-static"} and m.default_variant == "int4-static"
    assert m.build_config["speed_only"] == SPEED_ONLY and m.batched == {"skipped": SPEED_ONLY}
    for rec in m.variants.values():
        assert rec.passed and rec.gates == {"speed_only": {"passed": True, "why": SPEED_ONLY}}
        assert rec.row_guard  # guarded (or marked padded) as a full build writes it
    files = {p.name for p in folder.iterdir()}
    assert S.variant_file(S.FP32) not in files and S.REFERENCE_FILE not in files
    assert m.variants["int4-static"].calibration["key"]  # measured at build: bench measures nothing
    model = load("synth-speed", threads=1)
    assert model.variant == "int4-static"
    assert len(model.generate("hello", max_new_tokens=4).tokens) >= 1
    # int8 (what a full build defaults to on CPUs where its step is faster): int8 and its static flavour
    folder8 = speed_build(gguf_path, "synth-speed8", threads=1, precision="int8")
    m8 = read_checked_manifest(folder8)
    assert set(m8.variants) == {"int8", "int8-static"} and m8.default_variant == "int8-static"
    assert m8.variants["int8-static"].calibration["key"] and m8.variants["int8-static"].row_guard
    model8 = load("synth-speed8", threads=1)
    assert model8.variant == "int8-static" and len(model8.generate("hello", max_new_tokens=4).tokens) >= 1
    with pytest.raises(ExportError, match="int4, int8, int4op"):
        speed_build(gguf_path, "synth-speed2", threads=1, precision="fp16")
    # int4op (the file's blocks in our own operators): heads of 64, so the attention is ours too
    gguf_op = tmp_path / "op.gguf"
    write_llama_gguf(gguf_op, LlamaShapes(hidden=128, layers=1, heads=2, kv_heads=1, ffn=96, context=128), template)
    folder_op = speed_build(gguf_op, "synth-speed-op", threads=1, precision="int4op")
    mo = read_checked_manifest(folder_op)
    assert set(mo.variants) == {"int4op", "int4op-static"} and mo.default_variant == "int4op-static"
    assert {q41.DOMAIN, attn.DOMAIN} <= graph_domains(folder_op / mo.variants["int4op-static"].file)
    model_op = load("synth-speed-op", threads=1)
    assert model_op.variant == "int4op-static"
    plain = model_op.generate("hello", max_new_tokens=6).tokens
    assert len(plain) >= 1 and model_op.generate("hello", max_new_tokens=6, method="pld").tokens == plain
    # a full build of a name is never replaced by a speed-only one
    full = cache_dir / "synth-full"
    full.mkdir()
    (full / S.MANIFEST_FILE).write_text('{"build_config": {}}')
    with pytest.raises(CacheError, match="is a full build"):
        speed_build(gguf_path, "synth-full", threads=1)
