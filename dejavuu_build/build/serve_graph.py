"""The serving batch graph: the batched flavour of the variant `serve` decodes, written beside
it, gated and recorded as Manifest.batched."""

from __future__ import annotations

from pathlib import Path

from .. import schema as S
from ..errors import ContractError
from ..layouts import LAYOUTS
from ..log import logger, step
from ..schema import Manifest
from .digest import file_sha256


def write_serve_batch(
    folder: Path, manifest: Manifest, sessions: dict[str, tuple], threads: int, machine: dict, embed=None
) -> None:
    """The serving batch graph of the variant `serve` decodes, so that the server batches requests
    and still gives `generate`'s tokens (one model, one answer): a rowwise default gets its rowwise
    batched flavour (export.passes.serve_batch_rowwise), a static default its static one
    (export.passes.serve_batch), a concat default the static twin's (what `serve --variant <it>`
    batches): layouts.Layout.batch and .batch_pass. Written beside it with its weights referenced
    inside the variant's own file, not stored twice (export.shared_weights: 152 MB less for an
    int8 default on SmolLM2-135M), gated (gates.gate_serve_batch: requests side by side
    bit-identical to each alone) and recorded as Manifest.batched. One variant only, to keep the
    build short and the entry small; other variants serve one request per forward. A failing gate
    is recorded (passed false) and named in the summary, and the server never batches on it.
    Rewritten byte for byte from the same graph (quant-only), it keeps its gate on the same
    machine and onnxruntime."""
    from ..export.fp16_store import load_unpacked
    from ..export.shared_weights import save_sharing
    from ..runtime.decoder import Decoder
    from ..runtime.session import make_session
    from .gates import gate_serve_batch

    old, default = manifest.batched, manifest.default_variant
    layout = LAYOUTS[S.split_variant(default)[1]].batch if default else S.KV_STATIC
    target = S.variant_name(S.split_variant(default)[0], layout) if default else None
    rec = manifest.variants.get(target) if target else None
    if target is None or rec is None or not rec.passed:
        why = (
            "no variant passed its gates"
            if target is None
            else f"no {target} variant (--kv-layouts)"
            if rec is None
            else f"{target} did not pass its gates"
        )
        manifest.batched = {"skipped": why}
        logger.info("  no batched serving graph: %s; `serve` decodes one request per forward", why)
        return
    path = folder / S.batched_file(target)
    src_sha = file_sha256(folder / rec.file)
    prefill = rec.prefill if rec.prefill.get("passed") else {}  # the server prefills through it (Decoder.prefill)
    same_source = (
        old.get("variant") == target
        and old.get("source_sha256") == src_sha
        and old.get("prefill_sha256") == prefill.get("sha256")
        and old.get("graph_version") == S.BATCHED_GRAPH_VERSION
        and old.get("gate", {}).get("machine") == machine
    )
    with step(f"batched serving graph of {target} (requests side by side, each as alone)"):
        try:
            batch_pass = LAYOUTS[layout].batch_pass
            assert batch_pass is not None, f"the {layout} layout has no batched serving pass"
            proto = batch_pass(load_unpacked(folder / rec.file), rec.file)
        except ContractError as e:  # a graph the pass does not apply to: the build goes on without it
            manifest.batched = {"skipped": f"the batch pass does not apply to {target}: {e}"}
            logger.info("  no batched serving graph: %s", manifest.batched["skipped"])
            return
        path.unlink(missing_ok=True)  # a new file: a carried (linked) one is never written through
        # its weights are the variant's, byte for byte: referenced inside that file, not stored twice
        shared = save_sharing(proto, path, folder / rec.file)
        sha = file_sha256(path)
        if same_source and sha == old.get("sha256"):
            gate = old["gate"]
            logger.info("  rewritten byte for byte (sha256 %s…): its gate holds", sha[:12])
        else:
            sess, declared = sessions[target]
            try:
                pre = make_session(folder / prefill["file"], threads) if prefill else None
                gate = gate_serve_batch(Decoder(sess, declared, embed, pre), path, threads)
            except Exception as e:  # noqa: BLE001 - a graph onnxruntime cannot run fails its gate, named
                gate = {"passed": False, "error": " ".join(str(e).split())[:300], "mismatches": 0, "steps_checked": 0}
            gate["machine"] = machine
    manifest.batched = {
        "variant": target,
        "layout": layout,
        "file": path.name,
        "bytes": path.stat().st_size,
        "shared_bytes": shared,  # read from the variant's own file (export.shared_weights)
        "sha256": sha,
        "source_sha256": src_sha,
        "prefill_sha256": prefill.get("sha256"),  # the prompts' graph its gate ran (None: the decode graph)
        "graph_version": S.BATCHED_GRAPH_VERSION,
        "passed": bool(gate["passed"]),
        "gate": gate,
    }
    if not gate["passed"]:
        logger.warning(
            "⚠ the batched serving graph of %s failed its gate (%s): recorded, `serve` decodes one request per forward",
            target,
            gate.get("error") or f"{gate['mismatches']} of {gate['steps_checked']} request steps not bit-identical",
        )
