"""The row guard: measure each op of a variant for row invariance on this machine and guard the
ops that need two rows, so a lone token runs as one graph row (every layout: the static flavour
floors its attention rows in the graph itself); and the fp32 export as the quantizer must read it,
without a guard (unguarded)."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .. import schema as S
from ..log import logger, step
from ..schema import Manifest, VariantRecord, variant_file


def guard_variant(folder: Path, manifest: Manifest, v: str, contract, threads: int) -> None:
    """Measure every op of variant ``v`` for row invariance on this machine (export.exactness) and
    guard the ops that need two rows (export.passes.row_guard), so the graph is length-invariant
    by construction where its ops allow: a lone token then runs as one graph row, in our runtime or
    any other. Attention above head size 128 gets its key floor first (export.passes.key_floor), so
    a step's row count never changes how the kernel reduces a head. The static flavour's
    GroupQueryAttention is not probed: its floors (rows and keys) are part of the graph (static_kv),
    and the batched gate checks the whole graph."""

    from ..export.exactness import probe
    from ..export.exporter import save_model
    from ..export.fp16_store import load_unpacked
    from ..export.passes.key_floor import KEY_FLOOR, floor_keys, needs_key_floor
    from ..export.passes.row_guard import guard_rows

    precision, layout = S.split_variant(v)
    rec = manifest.variants.get(v) or manifest.variants.setdefault(v, VariantRecord(file=variant_file(v)))
    if rec.row_guard:  # carried from an earlier build (quant-only): measured and guarded there
        return
    path = folder / variant_file(v)
    if v == S.FP32:
        keep_unguarded(path)
    with step(f"row invariance of {v}, per op, on this CPU"):
        proto = load_unpacked(path)
        floored = layout == S.KV_CONCAT and needs_key_floor(contract.head_dim)
        if floored:  # before the probe: it measures each attention with its floor
            floor_keys(proto, contract.head_dim)
        rep = probe(proto, layout=layout, heads=contract.num_heads, head_dim=contract.head_dim, threads=threads)
        bad = [p for p in rep.probes if p.verdict == "variant"]  # the batched gate still checks the whole graph
        guard = rep.guard_nodes()
        summary: dict[str, Any] = {
            "length_invariant": not bad,
            "machine": rep.machine,
            "guarded": sorted({p.signature for p in rep.probes if p.verdict == "guardable"}),
            "guarded_nodes": len(guard),
            "not_exact": sorted(p.signature for p in bad),
            "first_break": rep.first_break.signature if rep.first_break else None,
            **({"key_floor": KEY_FLOOR} if floored else {}),
        }
        tmp = path.with_name(path.name + ".guard.tmp")  # a new file: a carried (linked) one is never written
        save_model(
            guard_rows(
                proto,
                guard,
                length_invariant=not bad,
                record={k: summary[k] for k in ("machine", "guarded", "key_floor") if k in summary},
            ),
            tmp,
        )
        os.replace(tmp, path)
    rec.row_guard = {**summary, "probes": [p.to_json() for p in rep.probes]}
    rec.length_invariant = not bad
    for p in rep.probes:
        logger.info(
            "  %-58s %-10s alone %d/%d, beside a pad row %d/%d",
            p.signature,
            p.verdict,
            p.equal_alone,
            p.rows,
            p.equal_padded,
            p.rows,
        )
    logger.info(
        "  %s: %s",
        v,
        f"length-invariant, {len(guard)} nodes guarded"
        if not bad
        else f"NOT length-invariant here ({', '.join(summary['not_exact'])}): lone tokens get a pad row",
    )


PRE_GUARD_PREFIX = ".pre-guard-"  # the fp32 export's bytes before its guard, for the build's later quantize calls


def keep_unguarded(path: Path) -> None:
    """Before the fp32 export is guarded (written anew and renamed over: guard_variant), keep its
    unguarded bytes under a second name (a hard link, no copy), so the auto build's later tiers
    quantize from it instead of loading, stripping and writing the whole export again (SmolLM2:
    ~4.5 s for each of int4op and int8); drop_unguarded removes it before the entry is recorded.
    Not for an export with external data, nor where the file system has no hard links."""
    kept = path.with_name(PRE_GUARD_PREFIX + path.name)
    kept.unlink(missing_ok=True)
    if path.is_file() and not path.with_name(path.name + ".data").exists():
        try:
            os.link(path, kept)
        except OSError:
            pass


def drop_unguarded(folder: Path) -> None:
    for f in Path(folder).glob(PRE_GUARD_PREFIX + "*"):
        f.unlink(missing_ok=True)


@contextmanager
def unguarded(path: Path, needed: bool):
    """``path`` as the quantizer must read it: without a row guard (guard_rows is applied last, per
    variant, after measuring it: guard_variant). The build's own unguarded bytes where it kept them
    (keep_unguarded); else a guarded fp32 export (a quant-only of a guarded build) is written
    unguarded to a temporary file beside it, removed afterwards."""
    import onnx

    from ..export.exporter import save_model
    from ..export.passes.row_guard import strip_row_guard

    kept = path.with_name(PRE_GUARD_PREFIX + path.name)
    if needed and kept.is_file():
        yield kept
        return
    proto = onnx.load(str(path), load_external_data=False) if needed else None
    if proto is None or not any("row_guard/" in n.name for n in proto.graph.node):
        yield path
        return
    tmp = path.with_name(".unguarded-" + path.name)
    try:
        save_model(strip_row_guard(onnx.load(str(path))), tmp)
        yield tmp
    finally:
        tmp.unlink(missing_ok=True)
        tmp.with_name(tmp.name + ".data").unlink(missing_ok=True)
