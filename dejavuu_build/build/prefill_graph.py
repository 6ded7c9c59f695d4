"""Each rowwise variant's prefill graph: prompt chunks as multi-row attention over the decode
graph's own buffer (export.passes.rowwise_prefill), written beside the variant, gated and recorded
as VariantRecord.prefill."""

from __future__ import annotations

from .. import precisions as P
from .. import schema as S
from ..errors import ContractError
from ..layouts import LAYOUTS
from ..log import logger, step
from .digest import file_sha256
from .validation import Gating


def write_prefill_graphs(g: Gating, only: str | None = None) -> None:
    """The prefill graph of every passing variant whose layout has one (layouts.Layout.prefill_pass: the
    rowwise layout), so its prompts prefill at the static flavour's speed while its decode steps
    keep one-row kernels (docs/speed.md). ``only``: the one variant that gets one (the auto build's
    default: its gate cost 13-19 s of a SmolLM2 build whose default was not rowwise); another
    rowwise variant records why it has none, and the runtime says so where it is opened. Saved by
    reference to the variant's weights (export.shared_weights: the file is the graph alone), gated by the quality gate of its variant's
    precision on the same set (teacher-forced top-1 and KL against fp32: the prefill graph's rows
    are the ones a prompt's K/V come from), and recorded with the variant's sha256, which a runtime
    checks before it prefills through it. A graph rewritten from the same variant bytes on the same
    machine keeps its gate; a variant that failed its gates gets none (nothing of it is served)."""
    from ..export.fp16_store import load_unpacked
    from ..export.shared_weights import save_sharing
    from ..runtime.session import make_session
    from .quality import gate_quality, scoring_set
    from .runner import Runner

    folder, manifest = g.folder, g.manifest
    written: dict[str, dict] = {}  # variant -> its record, gate still to come where none is kept
    for v, rec in sorted(manifest.variants.items(), key=lambda kv: S.variant_order(kv[0])):
        path = folder / S.prefill_file(v)
        layout = LAYOUTS[rec.kv_layout]
        if layout.prefill_pass is None or not rec.passed:
            path.unlink(missing_ok=True)
            rec.prefill = {}
            continue
        if only is not None and v != only:
            path.unlink(missing_ok=True)
            rec.prefill = {
                "skipped": f"not the default ({only}): an auto build writes the default's prefill graph only; "
                "a build naming its variants (--variants) writes every rowwise variant's"
            }
            continue
        old, src_sha = rec.prefill, file_sha256(folder / rec.file)
        with step(f"prefill graph of {v} (prompt chunks as multi-row attention over its buffer)"):
            try:
                proto = layout.prefill_pass(load_unpacked(folder / rec.file), rec.file)
            except ContractError as e:  # a graph the pass does not apply to: prompts run on the decode graph
                path.unlink(missing_ok=True)
                rec.prefill = {"skipped": str(e)}
                logger.info("  no prefill graph: %s", e)
                continue
            path.unlink(missing_ok=True)  # a new file: a carried (linked) one is never written through
            shared = save_sharing(proto, path, folder / rec.file)
        sha = file_sha256(path)
        written[v] = {
            "file": path.name,
            "bytes": path.stat().st_size,
            "shared_bytes": shared,  # read from the variant's own file (export.shared_weights)
            "sha256": sha,
            "source_sha256": src_sha,
        }
        if (
            sha == old.get("sha256")
            and old.get("source_sha256") == src_sha
            and old.get("gate", {}).get("machine") == g.machine
        ):
            written[v]["gate"] = old["gate"]
            logger.info("  rewritten byte for byte (sha256 %s…): its gate holds", sha[:12])
    todo = [v for v, r in written.items() if "gate" not in r]
    if todo:  # one pass over the quality set for all of them: fp32's logits computed once
        with step(f"quality of the prefill graphs of {', '.join(todo)}: teacher-forced top-1 and KL against fp32"):
            fp32 = Runner(*g.sessions[S.FP32], g.embed)
            runners = {
                v: Runner(
                    make_session(folder / written[v]["file"], threads=g.threads),
                    S.variant_contract(g.contract, manifest.variants[v]),
                    g.embed,
                )
                for v in todo
            }
            qs = scoring_set(folder, fp32, g.ref, min(c.position_limit for _, c in g.sessions.values()))
            for v, gate in gate_quality(fp32, runners, qs, P.quality_floors(), g.fp32_logits).items():
                written[v]["gate"] = {**gate, "machine": g.machine}
                own = manifest.variants[v].gates.get("quality", {})
                logger.info(
                    "  %s: top-1 %.4f, KL %.5f against fp32 (the decode graph: %s, %s)",
                    v,
                    gate["top1"],
                    gate["mean_kl"],
                    own.get("top1"),
                    own.get("mean_kl"),
                )
    for v, r in written.items():
        manifest.variants[v].prefill = {**r, "passed": bool(r["gate"]["passed"])}
        if not r["gate"]["passed"]:
            logger.warning(
                "⚠ the prefill graph of %s is under its quality floor (top-1 %s): recorded, its prompts run on the decode graph",
                v,
                r["gate"].get("top1"),
            )
