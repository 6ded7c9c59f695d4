"""Typed, serialisable build configs. Each CLI command fills one; the manifest records it."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from .. import __version__
from ..precisions import names as precision_names
from ..schema import DEFAULT_THREADS, FP32, INPUT_IDS, INPUTS_EMBEDS, KV_CONCAT, KV_LAYOUTS, VARIANTS
from .sources import DEFAULT_MODEL


@dataclass
class TreeDecoderConfig:
    model: str = DEFAULT_MODEL
    revision: str | None = None
    name: str | None = None
    # () = auto: the fp32 export + int4 in every KV layout, int8 only when no int4 keeps the model's
    # answers (pipeline._auto_variants); else an explicit list, fp32 first, every layout of each.
    variants: tuple[str, ...] = ()
    hidden_layer: int = -1
    primary_input: str = INPUT_IDS
    timing: bool = True
    threads: int = DEFAULT_THREADS
    reference_tokens: int = 24
    vision: bool = False  # `dejavuu-build vlm`: also the vision encoder + embeddings
    vision_position_ids: str = "trained"  # "trained" (what checkpoints learned) | "transformers" (4.55+)
    kv_layouts: tuple[str, ...] = KV_LAYOUTS  # concat (present = past + new), static and rowwise (in place)
    max_context: int | None = None  # in-place KV capacity [default: the model's limit, at most DEFAULT_MAX_CONTEXT]

    def validate(self) -> None:
        from ..errors import DejavuuError

        known = precision_names()
        bad = [v for v in self.variants if v not in known]
        if self.variants and (bad or FP32 not in self.variants):
            raise DejavuuError(
                f"--variants must be auto, or include fp32 and be among {', '.join(known)} "
                f"(got {', '.join(self.variants)})"
            )
        if self.primary_input not in (INPUT_IDS, INPUTS_EMBEDS):
            raise DejavuuError(f"--primary-input must be {INPUT_IDS} or {INPUTS_EMBEDS}")
        if self.vision and self.primary_input != INPUTS_EMBEDS:
            raise DejavuuError("a VLM build feeds its decoder inputs_embeds")
        if KV_CONCAT not in self.kv_layouts or any(k not in KV_LAYOUTS for k in self.kv_layouts):
            raise DejavuuError(
                f"--kv-layouts must include {KV_CONCAT} (the source of the others) and be among "
                f"{', '.join(KV_LAYOUTS)} (got {', '.join(self.kv_layouts)})"
            )
        if self.max_context is not None and not 64 <= self.max_context <= 1 << 20:
            raise DejavuuError(f"--max-context must be between 64 and {1 << 20} (got {self.max_context})")
        if self.vision_position_ids not in ("trained", "transformers"):
            raise DejavuuError("--vision-position-ids must be trained or transformers")

    def to_json(self) -> dict:
        d = asdict(self)
        d["variants"] = list(self.variants)
        d["kv_layouts"] = list(self.kv_layouts)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "TreeDecoderConfig":
        d = dict(d)
        d["variants"] = tuple(d.get("variants", VARIANTS))
        d["kv_layouts"] = tuple(d.get("kv_layouts", (KV_CONCAT,)))  # builds before the static flavour
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


def tool_versions() -> dict[str, str]:
    from importlib import metadata

    from ..cache import code_digest

    # The version string alone misses edits to the code that shapes the artifacts: hash that code.
    out = {"dejavuu-build": __version__, "dejavuu-build-code": code_digest()}
    for dist in ("torch", "transformers", "onnx", "onnxruntime", "onnxscript", "onnx-ir", "gguf"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def cache_key(config: TreeDecoderConfig, source_identity: str, tools: dict) -> str:
    """Hash of what determines the artifacts: model identity, build config, tool versions."""
    cfg = config.to_json()
    for k in ("name", "timing", "threads"):
        cfg.pop(k, None)
    blob = json.dumps({"config": cfg, "source": source_identity, "tools": tools}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]
