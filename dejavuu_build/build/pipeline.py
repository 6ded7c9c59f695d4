"""The build pipeline behind `tree-decoder` and `quant-only`: resolve, load, export, reference,
quantize, validate, then commit atomically into the cache. Each step is a module of its own:
export_step (load, export, references, tokenizer, contract; a VLM's vision through its recipe),
variants (quantize, the KV layouts' flavours: layouts.LAYOUTS), row_guard, validation (the gates),
timing, default (the default's choice), serve_graph (the serving batch graph), calibrate and
summary; this module runs them in order."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .. import precisions as P
from .. import schema as S
from ..cache import build_lock, check_replace, commit, entry_dir, link_or_copy, record_files, staging, verify_entry
from ..errors import CacheError
from ..layouts import BATCHED_LAYOUTS
from ..log import logger, step, timeline
from ..schema import Manifest, variant_file, write_json
from .calibrate import calibrate_default
from .config import TreeDecoderConfig, cache_key, tool_versions
from .default import choose_default, keeps_answers
from .digest import file_sha256
from .export_step import export_fp32
from .prefill_graph import write_prefill_graphs
from .row_guard import drop_unguarded, guard_variant
from .serve_graph import write_serve_batch
from .summary import failed_gates, log_summary, quality_line
from .timing import time_candidates
from .trial import trial_tiers
from .validation import Gating, gated, keep_same_bytes, open_gating, quality, validate
from .variants import Quantized, add_layouts, quantize


@dataclass
class BuildResult:
    folder: Path
    manifest: Manifest
    cache_hit: bool = False


def build_tree_decoder(cfg: TreeDecoderConfig, *, force: bool = False) -> BuildResult:
    from .sources import resolve

    cfg.validate()
    with step("resolve model source"):
        src = resolve(cfg.model, cfg.revision)
    name = cfg.name or src.default_name()
    tools = tool_versions()
    key = cache_key(cfg, src.identity, tools)
    final = entry_dir(name)
    with build_lock(name):
        # Never replaces another kind of entry; a different or broken build of this kind only with --force.
        old = check_replace(name, S.KIND_VLM if cfg.vision else S.KIND_DECODER, force=force, key=key)
        if old is not None:
            logger.info("✓ cache hit: %s is up to date (use --force to rebuild)", final)
            return BuildResult(final, old, cache_hit=True)
        with staging(name) as tmp:
            with timeline() as steps:
                manifest = export_fp32(cfg, src, tmp, name, key, tools)
                if cfg.variants:
                    _quantize_and_validate(
                        tmp, manifest, [v for v in cfg.variants if v != S.FP32], cfg.threads, cfg.timing
                    )
                else:
                    _auto_variants(tmp, manifest, cfg.threads, cfg.timing)
                _finish(tmp, manifest, steps)
            out = commit(tmp, name)
    return BuildResult(out, manifest)


def quant_only(
    name: str, *, variants: tuple[str, ...] | None = None, threads: int = S.DEFAULT_THREADS, timing: bool = True
) -> BuildResult:
    """Re-quantize from the stored fp32 export (no torch) and re-validate against saved references.

    Every file it carries into the new entry is verified first, and checked again as committed: a
    new manifest is never written over bytes nobody checked (a corrupt entry is refused, not blessed).
    ``variants``: the precisions to redo [default: every quantized precision of the table]."""
    from ..errors import IntegrityError

    if variants is None:  # every quantized precision this machine can run
        variants = tuple(v for v in P.quantized() if not _unrunnable(v))
    final = entry_dir(name)
    redo = {variant_file(S.variant_name(v, k)) for v in variants for k in S.KV_LAYOUTS}
    # the batched serving graph is written again from the variant it follows (serve_graph)
    redo |= {S.batched_file(S.variant_name(v, k)) for v in P.names() for k in BATCHED_LAYOUTS}
    try:
        with build_lock(name):
            if not (final / S.MANIFEST_FILE).is_file():
                raise CacheError(
                    f"no build named {name!r} in {final.parent}; run `dejavuu-build tree-decoder --name {name}` first"
                )
            try:
                manifest = verify_entry(final, skip=redo)  # all it carries; the variants it redoes are replaced
            except CacheError as e:
                raise CacheError(f"quant-only will not carry the files of an entry that does not verify: {e}") from None
            if manifest.kind not in S.DECODER_KINDS:
                raise CacheError(f"{name} is a {manifest.kind} entry: quant-only re-quantizes decoder builds")
            carried = {rel: rec["sha256"] for rel, rec in manifest.files.items() if rel not in redo}
            with staging(name) as tmp:
                for rel in carried:
                    link_or_copy(final / rel, tmp / rel)
                manifest.build_config["variants"] = _requant_variants(manifest, variants)
                with timeline() as steps:
                    _quantize_and_validate(tmp, manifest, list(variants), threads, timing, fp32_layouts=False)
                    _requant_key(manifest, tool_versions())
                    _finish(tmp, manifest, steps)
                drift = [rel for rel, sha in carried.items() if manifest.files.get(rel, {}).get("sha256") != sha]
                if drift:  # changed between the check and the copy: nothing is committed
                    raise IntegrityError(
                        f"{final / drift[0]} changed while quant-only ran; {name} is unchanged: "
                        f"run `dejavuu-build verify {name}`, then quant-only again"
                    )
                out = commit(tmp, name)
    except OSError as e:
        raise CacheError(
            f"could not write the re-quantized {name} under {final.parent} "
            f"({e.strerror or type(e).__name__}): free disk space or make the cache writable; "
            f"{name} is unchanged"
        ) from None
    return BuildResult(out, manifest)


def _requant_variants(manifest: Manifest, variants: tuple[str, ...]) -> list[str]:
    """The build config's variants after quant-only: an auto build ([]) stays auto while quant-only
    redoes precisions it holds; adding one makes the list explicit (fp32 and all it now holds)."""
    had = manifest.build_config.get("variants", [])
    held = {S.split_variant(v)[0] for v in manifest.variants}
    if not had and set(variants) <= held:
        return []
    return sorted(set(had or held) | {S.FP32} | set(variants), key=S.variant_order)


def _requant_key(manifest: Manifest, tools: dict) -> None:
    """Record the tools quant-only ran with; once the variants come from more than one toolchain,
    key the entry so that no fresh build (one toolchain) is a cache hit on it."""
    from .sources import identity_of

    cfg = TreeDecoderConfig.from_json(manifest.build_config)
    if tools != manifest.tools or "built_with" in manifest.export:
        manifest.export.setdefault("built_with", manifest.tools)  # the tools of the fp32 export
        manifest.tools = tools
        tools = {"export": manifest.export["built_with"], "requantized": tools}
    manifest.cache_key = cache_key(cfg, identity_of(manifest.source), tools)


def _quantize_and_validate(
    folder: Path, manifest: Manifest, variants: list[str], threads: int, timing: bool, *, fp32_layouts: bool = True
) -> None:
    """Quantize ``variants`` from the fp32 export and gate them, then time every variant and pick
    the default (quant-only and explicit --variants builds: one pass)."""
    g = open_gating(folder, manifest, threads)
    _add(g, variants, Quantized(), fp32_layouts=fp32_layouts)
    _settle(g, timing)


def _auto_variants(folder: Path, manifest: Manifest, threads: int, timing: bool) -> None:
    """The default build (--variants auto): the fp32 export (what a rebuild and quant-only start
    from) and the precisions of the table's first auto tier (int4) in every KV layout, the
    candidates the machine's measurements pick the default from; each next tier (int4op, int8) is added
    only when no variant of the tiers before passes its gates and keeps the model's answers
    (keeps_answers), so a user always gets a default that does; otherwise it is tried for speed
    (build.trial) and kept only where faster. fp32's in-place flavours (each as large as the fp32
    export: docs/quantization.md, Sizes) only on request."""
    g = open_gating(folder, manifest, threads)
    done = Quantized()
    built: list[str] = []
    for tier in P.auto_tiers():
        if built:
            made = {n: r for n, r in manifest.variants.items() if S.split_variant(n)[0] in built}
            if any(r.passed and keeps_answers(n, r) for n, r in made.items()):
                break
        tier = tuple(p for p in tier if not _unrunnable(p))
        if not tier:
            continue
        if built:
            why = "; ".join(f"{n}: {quality_line(r)}" for n, r in sorted(made.items()))
            logger.info(
                "%s does not keep the model's answers here (%s): adding %s",
                " or ".join(built),
                why or f"no {' or '.join(built)} variant",
                ", ".join(tier),
            )
        _add(g, list(tier), done, fp32_layouts=False)
        built += tier
    # the tiers not needed for the answers, tried for speed on this machine (build.trial)
    _settle(g, timing, trial_tiers(g, done, built) if timing else {})


def _add(g: Gating, variants: list[str], done: Quantized, *, fp32_layouts: bool = True) -> None:
    """Quantize ``variants`` (int8/int4) from the fp32 export, write their in-place flavours
    (and fp32's when ``fp32_layouts``), guard rows, and gate every variant not gated yet:
    validation against the torch references, then quality against fp32."""
    folder, manifest = g.folder, g.manifest
    before = dict(manifest.variants)  # quant-only: the records of the files it rewrites
    quantize(folder, manifest, variants, done)
    written = add_layouts(folder, manifest, variants, g.contract.max_positions, fp32=fp32_layouts)
    for v in variants + written:  # rewritten: a session opened on the old file is stale
        g.sessions.pop(v, None)
    todo = [S.FP32] + sorted((v for v in manifest.variants if v != S.FP32), key=S.variant_order)
    for v in todo:
        guard_variant(folder, manifest, v, g.contract, g.threads)
        keep_same_bytes(g, v, before.get(v))
    fresh = [v for v in todo if not gated(g, v)]
    for v in todo:
        validate(g, v, fresh=v in fresh)
    quality(g, [v for v in fresh if v != S.FP32])


def _settle(g: Gating, timing: bool, trials: dict[str, dict] | None = None) -> None:
    """Time the default's candidates, pick the default, write the prefill graphs (an auto build: the
    default's) and the serving batch graph, and calibrate what a runtime opens unasked.
    ``trials``: the speed trials of later tiers (build.trial), said in the default's reason."""
    manifest = g.manifest
    earlier_trials = manifest.default_reason.get("trials")  # quant-only: the build's
    timed = time_candidates(manifest, g.sessions) if timing else {}
    for v, rec in sorted(manifest.variants.items(), key=lambda kv: S.variant_order(kv[0])):
        if not rec.passed:
            logger.warning(
                "⚠ %s is under its gate (%s): flagged in the manifest, never picked as default", v, failed_gates(rec)
            )
    manifest.default_variant, manifest.default_reason = choose_default(manifest)
    if timed:
        manifest.default_reason["timed"] = sorted(timed, key=S.variant_order)
    if trials:
        manifest.default_reason["trials"] = trials
    elif earlier_trials:  # what the build measured, kept through a quant-only that ran none
        manifest.default_reason.setdefault("trials", earlier_trials)
    # an auto build: the default's prefill graph only (what it writes: only what the default needs)
    auto = not manifest.build_config.get("variants")
    write_prefill_graphs(g, only=manifest.default_variant if auto else None)
    write_serve_batch(g.folder, manifest, g.sessions, g.threads, g.machine, g.embed)
    calibrate_default(g.folder, manifest, g.sessions, g.threads, g.embed)


def _finish(folder: Path, manifest: Manifest, steps: list[tuple[str, float]] | None = None) -> None:
    drop_unguarded(folder)  # the fp32 export's unguarded bytes, kept for the build's quantize calls
    if steps is not None:
        manifest.steps = [[name, sec] for name, sec in steps]
    for rec in manifest.variants.values():
        f = folder / rec.file
        rec.bytes = f.stat().st_size
        rec.sha256 = file_sha256(f)
    record_files(folder, manifest)
    write_json(folder / S.MANIFEST_FILE, manifest.to_json())
    log_summary(manifest)


def _unrunnable(precision: str) -> bool:
    """A precision whose own operators cannot run here (said); the auto build and quant-only's
    default skip it (asked for by name, it is refused: variants.quantize)."""
    from .variants import operators_missing

    missing = operators_missing(precision)
    if missing:
        logger.info("skipping %s: %s", precision, missing)
    return bool(missing)
