"""Calibration at build: what the runtime measures before its first speculative step, measured
here for the variant a runtime opens unasked (the default) and stored in the manifest and the
runtime's calibration cache."""

from __future__ import annotations

from pathlib import Path

from .. import schema as S
from ..log import logger, step
from ..schema import Manifest
from .digest import file_sha256


def calibrate_default(folder: Path, manifest: Manifest, sessions: dict[str, tuple], threads: int, embed=None) -> None:
    """What the runtime measures before its first speculative step (runtime.calibration: verify
    exactness, tree period and tile), measured here on this machine for the variant a runtime opens
    unasked: the default, which `generate`, ``load()`` and `serve` decode (others measure on first
    use, with a line on screen; the static twin's tree-period search took 112 s of a 371 s build) and
    stored twice: in the manifest (the record) and in the runtime's calibration cache under the
    file's sha256, so the first ``generate`` after a build measures nothing. Another machine or
    onnxruntime has another key and measures again."""
    from ..cache import cache_root
    from ..runtime.calibration import Calibration, calibration_key, record_calibration
    from ..runtime.decoder import Decoder

    # per attention flavour, what the smallest precision found (searched there: its forwards are the cheapest)
    hints: dict[tuple[str, bool], Calibration] = {}
    default = manifest.default_variant
    # what a runtime opens without being told: the default (the server decodes it too)
    wanted = {default} if default else set()
    for v, (sess, declared) in sorted(
        sessions.items(), key=lambda kv: (S.variant_order(kv[0])[1], -S.variant_order(kv[0])[0])
    ):
        rec = manifest.variants[v]
        if not rec.passed or v not in wanted:
            continue
        flavour = (declared.kv_layout, declared.length_invariant)
        sha = file_sha256(folder / rec.file)
        if rec.calibration.get("key") == calibration_key(sha, threads):
            continue  # carried unchanged (quant-only) and measured on this machine already
        with step(f"exactness calibration of {v} (what the runtime would measure on first use)"):
            rec.calibration = record_calibration(
                Decoder(sess, declared, embed), sha, threads, cache_root() / S.RUNTIME_DIR, hints.get(flavour)
            )
        if rec.calibration["period"] is not None:
            hints[flavour] = Calibration.from_json(
                {k: rec.calibration[k] for k in ("version", "chain_exact", "period", "tile", "seconds")}
            )
        c = rec.calibration
        logger.info(
            "  %s: verify %s, tree period %s, tile %s (%.1fs)",
            v,
            "exact" if c["chain_exact"] else "NOT exact",
            c["period"],
            c["tile"],
            c["seconds"],
        )
