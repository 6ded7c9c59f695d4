"""build.export_step: the torch model is gone before the fp32 graph is opened for its contract (the
two side by side were two fp32 copies of the model: docs/sizes.md, Memory), and references=False
writes no torch references."""

import gc
import weakref

from tiny import save_tiny

from dejavuu_build import schema as S
from dejavuu_build.build import export_step, sources
from dejavuu_build.build.config import TreeDecoderConfig


def _export(tmp_path, monkeypatch, *, references: bool):
    src_dir = save_tiny("llama", tmp_path / "src")
    alive: list = []
    real_load, real_contract = sources.load_model_and_tokenizer, export_step._declared_contract

    def load(*a, **k):
        out = real_load(*a, **k)
        alive.append(weakref.ref(out[0]))
        return out

    def contract(*a, **k):
        gc.collect()  # whatever still references the model keeps it through a collection too
        alive.append(alive[0]() is not None)
        return real_contract(*a, **k)

    monkeypatch.setattr(sources, "load_model_and_tokenizer", load)
    monkeypatch.setattr(export_step, "_declared_contract", contract)
    cfg = TreeDecoderConfig(model=str(src_dir), name="x", reference_tokens=4)
    out = tmp_path / "out"
    out.mkdir()
    manifest = export_step.export_fp32(cfg, sources.resolve(str(src_dir)), out, "x", "k", {}, references=references)
    return alive[1], out, manifest


def test_model_freed_before_the_contract_session(tmp_path, monkeypatch):
    model_alive, out, manifest = _export(tmp_path, monkeypatch, references=True)
    assert model_alive is False
    assert (out / S.REFERENCE_FILE).is_file() and (out / S.variant_file(S.FP32)).is_file()
    assert manifest.export["nodes"] > 0 and (out / S.CONTRACT_FILE).is_file()


def test_no_references_when_not_asked(tmp_path, monkeypatch):
    model_alive, out, _ = _export(tmp_path, monkeypatch, references=False)
    assert model_alive is False and not (out / S.REFERENCE_FILE).exists()
    assert (out / S.variant_file(S.FP32)).is_file() and (out / S.CONTRACT_FILE).is_file()
