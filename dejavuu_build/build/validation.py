"""Gating variants: validate each against the torch references (gates.run_gates), then the
quantized ones' quality against fp32 (quality.gate_quality). A variant carried unchanged from an
earlier run (same bytes, gated on this machine and onnxruntime) keeps its gates: only new variants
are measured, each once; the sessions opened here are reused by timing, the serving batch graph
and calibration (Gating.sessions). Torch-free (quant-only runs it too)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import precisions as P
from .. import schema as S
from ..errors import ValidationFailed
from ..log import logger, step
from ..schema import REFERENCE_FILE, Contract, Manifest, VariantRecord, read_contract, variant_file
from .digest import file_sha256
from .quality import FP32Logits
from .summary import failed_gates, log_summary


@dataclass
class Gating:
    """A build folder opened for gating: its declared contract, the torch references, this
    machine, the embedder of an inputs_embeds build, and the sessions opened so far."""

    folder: Path
    manifest: Manifest
    threads: int
    contract: Contract
    ref: Any
    machine: dict
    embed: Any = None
    sessions: dict[str, tuple[Any, Contract]] = field(default_factory=dict)  # variant -> (session, its contract)
    fp32_logits: FP32Logits | None = None  # fp32's scored logits, shared by the build's quality passes


def open_gating(folder: Path, manifest: Manifest, threads: int) -> Gating:
    from ..machine import machine
    from .references import Reference

    contract = read_contract(folder)
    embed = None
    ref = Reference.load(folder / REFERENCE_FILE)
    mach = machine()
    if contract.primary_input == S.INPUTS_EMBEDS:
        from ..runtime.vision import load_embedder

        embed = load_embedder(folder, threads)
    return Gating(folder, manifest, threads, contract, ref, mach, embed, fp32_logits=FP32Logits())


def keep_same_bytes(g: Gating, v: str, old: VariantRecord | None) -> None:
    """A rewritten file byte-identical to the one it replaces (a deterministic quantizer, an
    unchanged fp32 export) keeps that file's record: its gates and calibration, measured on
    the same bytes, machine and onnxruntime, hold; nothing is measured twice."""
    rec = g.manifest.variants.get(v)
    if rec is None or old is None or rec is old or not old.sha256 or not old.gates:
        return
    if old.gates.get("batched_vs_incremental", {}).get("machine") != g.machine:
        return
    if file_sha256(g.folder / rec.file) == old.sha256:
        g.manifest.variants[v] = old
        logger.info("  %s: rewritten byte for byte (sha256 %s…): its gates and calibration hold", v, old.sha256[:12])


def gated(g: Gating, v: str) -> bool:
    """Gated already, on this machine and onnxruntime (a variant carried by quant-only)."""
    rec = g.manifest.variants.get(v)
    return bool(
        rec
        and rec.gates
        and rec.gates.get("batched_vs_incremental", {}).get("machine") == g.machine
        and (v == S.FP32 or "quality" in rec.gates)
    )


def validate(g: Gating, v: str, *, fresh: bool) -> None:
    """Open ``v`` (its graph checked against the declared contract) and, when ``fresh``, run its
    gates against the torch references. fp32 failing its parity gate stops the build."""
    from ..runtime.session import cross_check, derive_contract, make_session
    from .gates import run_gates

    manifest = g.manifest
    precision, _ = S.split_variant(v)
    rec = manifest.variants.get(v) or VariantRecord(file=variant_file(v))
    declared = S.variant_contract(g.contract, rec)
    if v in g.sessions and not fresh:
        return

    def opened():
        sess = make_session(g.folder / variant_file(v), threads=g.threads)
        cross_check(derive_contract(sess), declared, variant_file(v))
        return sess

    if not fresh:
        sess = opened()
        logger.info("  %s: carried unchanged, its gates measured on this machine and onnxruntime", v)
    else:
        with step(f"validate {v}"):
            sess = opened()
            res = run_gates(precision, sess, declared, g.ref, embed=g.embed)
        res["gates"]["batched_vs_incremental"]["machine"] = g.machine
        rec.gates, rec.passed = res["gates"], res["passed"]
    rec.bytes = (g.folder / rec.file).stat().st_size
    manifest.variants[v] = rec
    g.sessions[v] = (sess, declared)
    if v == S.FP32 and not rec.passed:
        log_summary(manifest)
        raise ValidationFailed(f"fp32 export failed its parity gate ({failed_gates(rec)}); the build was not written")


def quality(g: Gating, variants: list[str]) -> None:
    """The quality gate of ``variants`` (quantized, validated): teacher-forced top-1 and KL
    against fp32 over the quality set, each under its precision's floor."""
    from .quality import gate_quality, scoring_set
    from .runner import Runner

    if not variants:
        return
    fp32 = Runner(*g.sessions[S.FP32], g.embed)
    runners = {v: Runner(*g.sessions[v], g.embed) for v in variants}
    with step(f"quality of {', '.join(variants)}: teacher-forced top-1 and KL against fp32 over the quality set"):
        limit = min(c.position_limit for _, c in g.sessions.values())
        qs = scoring_set(g.folder, fp32, g.ref, limit)
        for v, gate in gate_quality(fp32, runners, qs, P.quality_floors(), g.fp32_logits).items():
            rec = g.manifest.variants[v]
            rec.gates["quality"] = gate
            rec.passed = rec.passed and gate["passed"]
