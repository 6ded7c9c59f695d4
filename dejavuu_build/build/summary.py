"""The build's closing summary on screen: each variant's gates, row guard, timings and size, the
serving batch graph, why the default, where the time went."""

from __future__ import annotations

import json

from .. import schema as S
from ..log import logger
from ..schema import Manifest, VariantRecord


def failed_gates(rec: VariantRecord) -> str:
    """The gates ``rec`` failed, each with its figures."""
    return ", ".join(
        f"{k}={json.dumps({x: y for x, y in g.items() if x != 'passed'})}"
        for k, g in rec.gates.items()
        if not g.get("passed")
    )


def quality_line(rec: VariantRecord) -> str:
    """The quality gate's figures of ``rec`` in one line (or why it has none)."""
    q = rec.gates.get("quality")
    if not rec.passed and q is None:
        return f"failed {failed_gates(rec)}"
    return f"top-1 {q['top1']:.3f}, KL {q['mean_kl']:.4f}" if q else "no quality gate"


def log_summary(manifest: Manifest) -> None:
    """The build's summary on screen."""
    logger.info("")
    logger.info(
        "%s  (recipe %s, export %.1fs, %s nodes)",
        manifest.name,
        manifest.recipe,
        manifest.export.get("seconds", 0),
        manifest.export.get("nodes", "?"),
    )
    for v, rec in sorted(manifest.variants.items(), key=lambda kv: S.variant_order(kv[0])):
        mark = "✓" if rec.passed else "✗"
        parts = []
        for g, r in rec.gates.items():
            m = "✓" if r.get("passed") else "✗"
            if g == "parity":
                parts.append(f"{m} parity chain {r['chain_logits_maxdiff']:.1e} tree {r['tree_logits_maxdiff']:.1e}")
            elif g == "teacher_forced":
                parts.append(f"{m} top-1 {r['agree']}/{r['total']} (floor {r['floor']:.2f})")
            elif g == "quality":
                parts.append(
                    f"{m} quality top-1 {r['top1']:.3f} KL {r['mean_kl']:.4f} over {r['positions']} "
                    f"(floor {r['floor']:.2f})"
                )
            elif g == "batched_vs_incremental":
                parts.append(f"{m} batched=incremental {r['total'] - r['mismatches']}/{r['total']}")
            else:  # a gate with no figures (bench.synthetic's speed_only record)
                parts.append(f"{m} {g}")
        g = rec.row_guard
        if g:
            parts.append(
                f"lone token = 1 row ({g.get('guarded_nodes', 0)} ops guarded)"
                if rec.length_invariant
                else "lone token padded"
                + (f" ({', '.join(g['not_exact'])} not row-exact)" if g.get("not_exact") else "")
            )
        pf = rec.prefill.get("gate")
        if pf:
            parts.append(
                f"{'✓' if rec.prefill['passed'] else '✗'} prefill graph top-1 {pf['top1']:.3f} KL {pf['mean_kl']:.4f}"
            )
        t = rec.timings_ms
        tim = f"  N1/N2/N8@256 {t['n1_p256']:.1f}/{t['n2_p256']:.1f}/{t['n8_p256']:.1f} ms" if "n1_p256" in t else ""
        dflt = "  [default]" if v == manifest.default_variant else ""
        logger.info(" %s %-11s %7.1f MB  %s%s%s", mark, v, rec.bytes / 1e6, " · ".join(parts), tim, dflt)
    b = manifest.batched
    if b.get("file"):
        g = b["gate"]
        logger.info(
            " %s %-11s %7.1f MB  %s batched serving of %s: %s",
            "✓" if b["passed"] else "✗",
            "(batched)",
            b["bytes"] / 1e6,
            "✓" if b["passed"] else "✗",
            b["variant"],
            f"failed to run ({g['error']})"
            if g.get("error")
            else f"{g['requests']} requests side by side, "
            f"{g['steps_checked'] - g['mismatches']}/{g['steps_checked']} steps bit-identical to alone",
        )
    elif b.get("skipped"):
        logger.info(" - no batched serving graph: %s", b["skipped"])
    why = manifest.default_reason
    if manifest.default_variant and why:
        if why.get("clearly_faster"):
            r = (why.get("cost_ratio") or {}).get(manifest.default_variant)
            how = f"clearly faster than {why['preferred']} over {why['rounds']} interleaved rounds" + (
                f" (cost ratio {r['median']:.2f} +- {r.get('error', r['sd']):.2f})" if r else ""
            )
        elif "margin" in why:
            how = (
                f"the preferred passing variant; nothing faster by > {why['margin']:.0%} clear of its ratio noise "
                f"(largest ratio sd {why['noise']:.1%}, {why['rounds']} interleaved rounds)"
            )
        else:
            how = "the preferred passing variant: smallest precision, then the layouts' preference (not timed)"
        if "margin" in why and why.get("timing"):  # kept from an earlier timing of this entry
            how += f"; {why['timing']}"
        logger.info(" default %s: %s", manifest.default_variant, how)
        if why.get("timed"):
            skip = why.get("not_candidates") or {}
            logger.info(
                " timed %s%s",
                ", ".join(why["timed"]),
                f"; not timed, as no default: {', '.join(f'{v} ({w})' for v, w in skip.items())}" if skip else "",
            )
        for v, t in (why.get("trials") or {}).items():
            if t.get("skipped"):
                logger.info(" not tried %s: %s", v, t["skipped"])
                continue
            logger.info(
                " tried %s for speed: %.2fx the step cost of %s, %s",
                v,
                t["ratio"],
                t["against"],
                "kept as a candidate"
                if t["kept"]
                else f"replaced by {t['superseded_by']} (faster)"
                if t.get("superseded_by")
                else "not kept (not clearly faster)",
            )
    if manifest.steps:
        total = sum(sec for _, sec in manifest.steps)
        top = sorted(manifest.steps, key=lambda x: -x[1])[:6]
        logger.info(" time %.0fs: %s", total, ", ".join(f"{n.split(' (')[0]} {sec:.0f}s" for n, sec in top))
