"""Producing variants: quantize precisions from the fp32 export, and write each variant's in-place
KV flavours with its layout's graph pass (layouts.LAYOUTS)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .. import precisions as P
from .. import schema as S
from ..errors import ExportError, KernelUnavailable
from ..layouts import DERIVED_LAYOUTS, LAYOUTS, capacity
from ..log import logger, step
from ..schema import Manifest, VariantRecord, variant_file
from .row_guard import unguarded


@dataclass
class Quantized:
    """What a build quantized, over every quantize() of it (the auto build's tiers), as
    Manifest.quantize records it."""

    variants: list[str] = field(default_factory=list)
    seconds: float = 0.0


def quantize(folder: Path, manifest: Manifest, variants: list[str], done: Quantized) -> None:
    """Quantize ``variants`` (int8/int4) from the fp32 export (read without its row guard:
    row_guard.unguarded), each with its precision's plan; a GGUF source's own blocks are carried."""
    from ..quantize import quantize_model
    from .sources import gguf_of

    for v in variants:
        missing = operators_missing(v)
        if missing:
            raise KernelUnavailable(f"{v} runs our own operator, which this machine cannot: {missing}")
    gguf = gguf_of(manifest.source) if variants else None
    with unguarded(folder / variant_file(S.FP32), bool(variants)) as source:
        for v in variants:
            with step(f"quantize {v}" + (f" (carrying {gguf.name}'s own blocks)" if gguf else "")) as t:
                rep = quantize_model(
                    source,
                    folder / variant_file(v),
                    P.plan(v),
                    tied=manifest.export.get("tied_embeddings"),
                    gguf=gguf,
                )
            done.seconds += t.seconds
            done.variants.append(v)
            manifest.variants[v] = VariantRecord(file=variant_file(v), quant=rep)
    if variants:
        manifest.quantize = {"seconds": round(done.seconds, 1), "variants": list(done.variants)}


def operators_missing(precision: str) -> str | None:
    """Why ``precision``'s own operators (precisions.Precision.operators) cannot run on this
    machine, or None where they build and load (or it needs none)."""
    from ..kernels import unavailable

    ops = P.PRECISIONS[precision].operators
    return unavailable(ops) if ops else None


def add_layouts(folder: Path, manifest: Manifest, variants: list[str], max_positions: int, *, fp32: bool) -> list[str]:
    """Write the in-place flavours (the build config's kv_layouts) of ``variants``, and of fp32
    where ``fp32`` and not written yet; the variants written. A layout with no flavour for this
    model stops at its first refusal (layouts.Layout.optional)."""
    layouts = manifest.build_config.get("kv_layouts", [S.KV_CONCAT])
    cap = capacity(manifest.build_config.get("max_context"), max_positions)
    written = []
    for layout in (k for k in DERIVED_LAYOUTS if k in layouts):
        with_fp32 = fp32 and S.variant_name(S.FP32, layout) not in manifest.variants
        for v in ([S.FP32] if with_fp32 else []) + variants:
            if not layout_variant(folder, manifest, v, cap, layout):
                break
            written.append(S.variant_name(v, layout))
    return written


def layout_variant(folder: Path, manifest: Manifest, precision: str, capacity: int, layout: str) -> bool:
    """``<precision>-<layout>``: an in-place KV flavour of an already written variant file. False
    when the graph has no such flavour (said once; the build goes on without it)."""
    from ..export.exporter import save_model
    from ..export.fp16_store import load_unpacked
    from ..export.passes.own_operators import to_own_operators
    from ..kernels import attn

    name = S.variant_name(precision, layout)
    lay = LAYOUTS[layout]
    assert lay.graph_pass is not None, f"the {layout} layout is the export itself"
    with step(lay.step.format(p=precision, c=capacity)):
        try:
            proto = lay.graph_pass(load_unpacked(folder / variant_file(precision)), capacity)
            if layout == S.KV_STATIC and attn.DOMAIN in P.PRECISIONS[precision].operators:
                proto = to_own_operators(proto)
        except ExportError as e:
            if not lay.optional:
                raise
            logger.info("  no %s flavour for this model: %s", layout, e)
            return False
        save_model(proto, folder / variant_file(name))
    base = manifest.variants.get(precision)
    manifest.variants[name] = VariantRecord(
        file=variant_file(name), quant=dict(base.quant) if base else {}, kv_layout=layout, kv_capacity=capacity
    )
    return True
