"""The build pipeline behind `tree-decoder` and `quant-only`: resolve, load, export, reference,
quantize, validate, then commit atomically into the cache."""

from __future__ import annotations

import datetime as _dt
import json
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import precisions as P
from .. import schema as S
from ..cache import build_lock, check_replace, commit, entry_dir, link_or_copy, record_files, staging, verify_entry
from ..errors import CacheError, ContractError, ExportError, ValidationFailed
from ..log import logger, step, timeline
from ..schema import (
    REFERENCE_FILE,
    TOKENIZER_FILES,
    Contract,
    Manifest,
    VariantRecord,
    read_contract,
    variant_file,
    write_json,
)
from .config import TreeDecoderConfig, cache_key, tool_versions


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
                manifest = _export(cfg, src, tmp, name, key, tools)
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

    variants = P.quantized() if variants is None else variants
    final = entry_dir(name)
    redo = {variant_file(S.variant_name(v, k)) for v in variants for k in S.KV_LAYOUTS}
    # the batched serving graph is written again from the variant it follows (_serve_batch)
    redo |= {S.batched_file(S.variant_name(v, k)) for v in P.names() for k in (S.KV_STATIC, S.KV_ROWWISE)}
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


def _export(cfg: TreeDecoderConfig, src, tmp: Path, name: str, key: str, tools: dict) -> Manifest:
    from ..export.exporter import export_decoder, text_dims
    from .references import compute_reference
    from .sources import load_model_and_tokenizer

    with step(f"load {src.id}"):
        model, tok, gen, recipe = load_model_and_tokenizer(src, hidden_layer=cfg.hidden_layer)
    with step(f"export fp32 ({recipe.name} recipe, dynamo, opset 23)") as t_exp:
        info = export_decoder(
            model, recipe, tmp / variant_file(S.FP32), hidden_layer=cfg.hidden_layer, primary=cfg.primary_input
        )
    with step("torch fp32 references (greedy continuations, chain and tree parity)"):
        ref = compute_reference(
            model,
            recipe,
            tok,
            hidden_layer=cfg.hidden_layer,
            new_tokens=cfg.reference_tokens,
            primary=cfg.primary_input,
        )
        ref.save(tmp / REFERENCE_FILE)
    lm = recipe.text_causal_lm(model)
    extra: dict = {}
    if cfg.primary_input == S.INPUTS_EMBEDS:
        from ..export.vision import export_embeddings

        with step("export token embedding"):
            extra["embeddings"] = export_embeddings(lm, tmp / S.EMBED_FILE)
    if cfg.vision:
        extra["vision"] = _export_vision(cfg, src, model, tmp)
    _save_tokenizer(tok, gen, tmp)
    dims = text_dims(recipe, model.config)
    contract = _declared_contract(tmp, cfg, recipe, model, gen, dims)
    write_json(tmp / S.CONTRACT_FILE, contract.to_json())
    return Manifest(
        name=name,
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        cache_key=key,
        build_config=cfg.to_json(),
        source=src.to_json(),
        recipe=recipe.name,
        tools=tools,
        export={
            "seconds": round(t_exp.seconds, 1),
            "torch_export_seconds": round(info.seconds, 1),
            "nodes": info.nodes,
            "opset": info.opset,
            "op_counts": info.op_counts,
            "tied_embeddings": info.tied_embeddings,
            "hidden_layer": cfg.hidden_layer,
            **extra,
        },
        kind=S.KIND_VLM if cfg.vision else S.KIND_DECODER,
    )


def _export_vision(cfg, src, model, tmp: Path) -> dict:
    """Vision encoder + connector graph, processor settings and the image-token facts the runtime needs."""
    from ..export.vision import export_vision, vision_dims

    recipe_vlm = hasattr(model.config, "vision_config")
    if not recipe_vlm:
        raise ValidationFailed(f"{src.id} has no vision tower: use `dejavuu-build tree-decoder` for text models")
    with step("export vision encoder + connector"):
        info = export_vision(model, tmp / S.VISION_FILE, position_ids=cfg.vision_position_ids)
    dims = vision_dims(model.config)
    pre = _processor_config(src, dims)
    write_json(tmp / S.PREPROCESSOR_FILE, pre)
    if int(pre.get("max_image_size", {}).get("longest_edge", dims["image_size"])) != dims["image_size"]:
        raise ValidationFailed("processor max_image_size differs from the vision tower's image_size")
    write_json(
        tmp / S.VLM_FILE,
        {
            **dims,
            "image_token": "<image>",
            "fake_image_token": "<fake_token_around_image>",
            "global_image_token": "<global-img>",
            "position_ids": cfg.vision_position_ids,
        },
    )
    return info


def _processor_config(src, dims: dict) -> dict:
    """The checkpoint's preprocessor_config.json, or SmolVLM's defaults sized to this vision tower."""
    folder = Path(src.path) if Path(src.path).is_dir() else Path(src.path).parent
    f = folder / S.PREPROCESSOR_FILE
    if f.is_file():
        return json.loads(f.read_text())
    from transformers.models.smolvlm.image_processing_smolvlm import SmolVLMImageProcessor

    size = dims["image_size"]
    return SmolVLMImageProcessor(size={"longest_edge": 4 * size}, max_image_size={"longest_edge": size}).to_dict()


def _declared_contract(folder: Path, cfg, recipe, model, gen, dims) -> Contract:
    from ..runtime.session import derive_contract, make_session

    c = derive_contract(make_session(folder / variant_file(S.FP32), threads=1))
    c.hidden_layer = cfg.hidden_layer
    c.num_heads = dims["num_heads"]
    c.max_positions = dims["max_positions"]
    c.sliding_window = recipe.sliding_windows(model.config)
    c.eos_token_ids = recipe.eos_token_ids(model.config, gen)
    tc = recipe.text_config(model.config)
    c.bos_token_id = getattr(tc, "bos_token_id", None)
    c.pad_token_id = getattr(tc, "pad_token_id", None)
    if c.hidden_size == 0:
        c.hidden_size = dims["hidden_size"]
    return c


def _save_tokenizer(tok, gen, folder: Path) -> None:
    if tok is None:
        return
    tmpdir = folder / ".tok"
    tok.save_pretrained(tmpdir)
    if gen is not None:
        gen.save_pretrained(tmpdir)
    for f in TOKENIZER_FILES:
        if (tmpdir / f).is_file():
            (tmpdir / f).rename(folder / f)
    if not (folder / S.TOKENIZER_FILE).is_file():
        raise ValidationFailed(f"the tokenizer could not be saved as {S.TOKENIZER_FILE} (a fast tokenizer is required)")
    if not (folder / S.CHAT_TEMPLATE_FILE).is_file() and getattr(tok, "chat_template", None):
        (folder / S.CHAT_TEMPLATE_FILE).write_text(tok.chat_template)
    import shutil

    shutil.rmtree(tmpdir, ignore_errors=True)


def _quantize_and_validate(
    folder: Path, manifest: Manifest, variants: list[str], threads: int, timing: bool, *, fp32_layouts: bool = True
) -> None:
    """Quantize ``variants`` from the fp32 export and gate them, then time every variant and pick
    the default (quant-only and explicit --variants builds: one pass)."""
    g = _Gates(folder, manifest, threads)
    g.add(variants, fp32_layouts=fp32_layouts)
    g.settle(timing)


def _auto_variants(folder: Path, manifest: Manifest, threads: int, timing: bool) -> None:
    """The default build (--variants auto): the fp32 export (what a rebuild and quant-only start
    from) and the precisions of the table's first auto tier (int4) in every KV layout, the
    candidates the machine's measurements pick the default from; each next tier (int8) is added
    only when no variant of the tiers before passes its gates and keeps the model's answers
    (keeps_answers), so a user always gets a default that does. fp32's in-place flavours (each as
    large as the fp32 export: docs/quantization.md, Sizes) only on request."""
    g = _Gates(folder, manifest, threads)
    built: list[str] = []
    for tier in P.auto_tiers():
        if built:
            made = {n: r for n, r in manifest.variants.items() if S.split_variant(n)[0] in built}
            if any(r.passed and keeps_answers(n, r) for n, r in made.items()):
                break
            why = "; ".join(f"{n}: {_quality_line(r)}" for n, r in sorted(made.items()))
            logger.info(
                "%s does not keep the model's answers here (%s): adding %s",
                " or ".join(built),
                why or f"no {' or '.join(built)} variant",
                ", ".join(tier),
            )
        g.add(list(tier), fp32_layouts=False)
        built += tier
    g.settle(timing)


def _quality_line(rec: VariantRecord) -> str:
    q = rec.gates.get("quality")
    if not rec.passed and q is None:
        return f"failed {_failed(rec)}"
    return f"top-1 {q['top1']:.3f}, KL {q['mean_kl']:.4f}" if q else "no quality gate"


class _Gates:
    """Quantize, guard and gate variants into a build folder, then time them and pick the default.
    Torch-free (quant-only runs it too). A variant carried unchanged from an earlier run (same
    bytes, gated on this machine and onnxruntime) keeps its gates: only new variants are measured,
    each once; the sessions opened for the gates are reused by timing and calibration."""

    def __init__(self, folder: Path, manifest: Manifest, threads: int):
        from ..export.exactness import machine
        from .references import Reference

        self.folder, self.manifest, self.threads = folder, manifest, threads
        self.contract = read_contract(folder)
        self.ref = Reference.load(folder / REFERENCE_FILE)
        self.machine = machine()
        self.embed = None
        if self.contract.primary_input == S.INPUTS_EMBEDS:
            from ..runtime.vision import load_embedder

            self.embed = load_embedder(folder, threads)
        self.sessions: dict[str, tuple[Any, Contract]] = {}  # variant -> (session, its contract)
        self.quantized: list[str] = []
        self.t_quantize = 0.0

    def add(self, variants: list[str], *, fp32_layouts: bool = True) -> None:
        """Quantize ``variants`` (int8/int4) from the fp32 export, write their in-place flavours
        (and fp32's when ``fp32_layouts``), guard rows, and gate every variant not gated yet:
        validation against the torch references, then quality against fp32."""
        from ..quantize import quantize_model
        from .sources import gguf_of

        folder, manifest = self.folder, self.manifest
        before = dict(manifest.variants)  # quant-only: the records of the files it rewrites
        gguf = gguf_of(manifest.source) if variants else None
        with _unguarded(folder / variant_file(S.FP32), bool(variants)) as source:
            for v in variants:
                with step(f"quantize {v}" + (f" (carrying {gguf.name}'s own blocks)" if gguf else "")) as t:
                    rep = quantize_model(
                        source,
                        folder / variant_file(v),
                        P.plan(v),
                        tied=manifest.export.get("tied_embeddings"),
                        gguf=gguf,
                    )
                self.t_quantize += t.seconds
                self.quantized.append(v)
                manifest.variants[v] = VariantRecord(file=variant_file(v), quant=rep)
                self.sessions.pop(v, None)
        if variants:
            manifest.quantize = {"seconds": round(self.t_quantize, 1), "variants": list(self.quantized)}
        layouts = manifest.build_config.get("kv_layouts", [S.KV_CONCAT])
        capacity = static_capacity(manifest.build_config.get("max_context"), self.contract.max_positions)
        for layout in (k for k in S.KV_LAYOUTS if k != S.KV_CONCAT and k in layouts):
            fp32 = fp32_layouts and S.variant_name(S.FP32, layout) not in manifest.variants
            for v in ([S.FP32] if fp32 else []) + variants:
                if not _layout_variant(folder, manifest, v, capacity, layout):
                    break
                self.sessions.pop(S.variant_name(v, layout), None)
        todo = [S.FP32] + sorted((v for v in manifest.variants if v != S.FP32), key=S.variant_order)
        for v in todo:
            _row_guard(folder, manifest, v, self.contract, self.threads)
            self._same_bytes(v, before.get(v))
        fresh = [v for v in todo if not self._gated(v)]
        for v in todo:
            self._validate(v, fresh=v in fresh)
        self._quality([v for v in fresh if v != S.FP32])

    def _same_bytes(self, v: str, old: VariantRecord | None) -> None:
        """A rewritten file byte-identical to the one it replaces (a deterministic quantizer, an
        unchanged fp32 export) keeps that file's record: its gates and calibration, measured on
        the same bytes, machine and onnxruntime, hold; nothing is measured twice."""
        rec = self.manifest.variants.get(v)
        if rec is None or old is None or rec is old or not old.sha256 or not old.gates:
            return
        if old.gates.get("batched_vs_incremental", {}).get("machine") != self.machine:
            return
        if _sha256(self.folder / rec.file) == old.sha256:
            self.manifest.variants[v] = old
            logger.info(
                "  %s: rewritten byte for byte (sha256 %s…): its gates and calibration hold", v, old.sha256[:12]
            )

    def _gated(self, v: str) -> bool:
        """Gated already, on this machine and onnxruntime (a variant carried by quant-only)."""
        rec = self.manifest.variants.get(v)
        return bool(
            rec
            and rec.gates
            and rec.gates.get("batched_vs_incremental", {}).get("machine") == self.machine
            and (v == S.FP32 or "quality" in rec.gates)
        )

    def _validate(self, v: str, *, fresh: bool) -> None:
        from ..runtime.session import cross_check, derive_contract, make_session
        from .gates import run_gates

        manifest = self.manifest
        precision, _ = S.split_variant(v)
        rec = manifest.variants.get(v) or VariantRecord(file=variant_file(v))
        declared = S.variant_contract(self.contract, rec)
        if v in self.sessions and not fresh:
            return

        def opened():
            sess = make_session(self.folder / variant_file(v), threads=self.threads)
            cross_check(derive_contract(sess), declared, variant_file(v))
            return sess

        if not fresh:
            sess = opened()
            logger.info("  %s: carried unchanged, its gates measured on this machine and onnxruntime", v)
        else:
            with step(f"validate {v}"):
                sess = opened()
                res = run_gates(precision, sess, declared, self.ref, embed=self.embed)
            res["gates"]["batched_vs_incremental"]["machine"] = self.machine
            rec.gates, rec.passed = res["gates"], res["passed"]
        rec.bytes = (self.folder / rec.file).stat().st_size
        manifest.variants[v] = rec
        self.sessions[v] = (sess, declared)
        if v == S.FP32 and not rec.passed:
            _summary(manifest)
            raise ValidationFailed(f"fp32 export failed its parity gate ({_failed(rec)}); the build was not written")

    def _quality(self, variants: list[str]) -> None:
        from .quality import gate_quality, scoring_set
        from .runner import Runner

        if not variants:
            return
        fp32 = Runner(*self.sessions[S.FP32], self.embed)
        runners = {v: Runner(*self.sessions[v], self.embed) for v in variants}
        with step(f"quality of {', '.join(variants)}: teacher-forced top-1 and KL against fp32 over the quality set"):
            limit = min(c.position_limit for _, c in self.sessions.values())
            qs = scoring_set(self.folder, fp32, self.ref, limit)
            for v, g in gate_quality(fp32, runners, qs, P.quality_floors()).items():
                rec = self.manifest.variants[v]
                rec.gates["quality"] = g
                rec.passed = rec.passed and g["passed"]

    def settle(self, timing: bool) -> None:
        """Time the default's candidates interleaved (_candidates: what timing can choose between;
        rounds stop once no other can displace the preferred one), pick the default, calibrate
        what a runtime opens unasked."""
        manifest = self.manifest
        timed: dict[str, dict] = {}
        if timing:
            from .timing import time_interleaved

            cands, _, skip = _candidates(manifest)
            first = min(cands, key=_preference(manifest, cands)) if cands else None
            chosen = {v: s for v, s in self.sessions.items() if v in cands}
            if chosen:
                with step(f"time {', '.join(sorted(chosen, key=S.variant_order))}, interleaved"):
                    timed = time_interleaved(
                        chosen,
                        min_rounds=min(len(chosen), 2),
                        settled=lambda per_round: _settled(per_round, str(first)),
                    )
            for v in manifest.variants:
                if v not in timed:  # what this run did not time carries no older figures
                    rec = manifest.variants[v]
                    rec.timings_ms, rec.timing_rounds_ms, rec.verify_cost_ratio = {}, [], None
            if skip:
                logger.info(
                    "  not timed (cannot be the default): %s", "; ".join(f"{v}: {w}" for v, w in sorted(skip.items()))
                )
            for v, t in timed.items():
                rec = manifest.variants[v]
                rec.timings_ms, rec.timing_rounds_ms = t["timings_ms"], t["round_costs_ms"]
                tm = rec.timings_ms
                if "n1_p256" in tm:
                    rec.verify_cost_ratio = round(tm["n8_p256"] / tm["n1_p256"], 2)
                    tm["pad_cost_ratio"] = round(tm["n2_p256"] / tm["n1_p256"], 2)
        for v, rec in sorted(manifest.variants.items(), key=lambda kv: S.variant_order(kv[0])):
            if not rec.passed:
                logger.warning(
                    "⚠ %s is under its gate (%s): flagged in the manifest, never picked as default", v, _failed(rec)
                )
        manifest.default_variant, manifest.default_reason = _choose_default(manifest)
        if timed:
            manifest.default_reason["timed"] = sorted(timed, key=S.variant_order)
        _serve_batch(self.folder, manifest, self.sessions, self.threads, self.machine, self.embed)
        _calibrate(self.folder, manifest, self.sessions, self.threads, self.embed)


def _serve_batch(
    folder: Path, manifest: Manifest, sessions: dict[str, tuple], threads: int, machine: dict, embed=None
) -> None:
    """The serving batch graph of the variant `serve` decodes, so that the server batches requests
    and still gives `generate`'s tokens (one model, one answer): a rowwise default gets its rowwise
    batched flavour (export.passes.serve_batch_rowwise), a static default its static one
    (export.passes.serve_batch), a concat default the static twin's (what `serve --variant <it>`
    batches). Written beside it, gated (gates.gate_serve_batch: requests side by side
    bit-identical to each alone) and recorded as Manifest.batched. One variant only, to keep the
    build short and the entry small; other variants serve one request per forward. A failing gate
    is recorded (passed false) and named in the summary, and the server never batches on it.
    Rewritten byte for byte from the same graph (quant-only), it keeps its gate on the same
    machine and onnxruntime."""
    import onnx

    from ..export.exporter import save_model
    from ..export.passes.serve_batch import to_serve_batch
    from ..export.passes.serve_batch_rowwise import to_serve_batch_rowwise
    from ..runtime.decoder import Decoder
    from .gates import gate_serve_batch

    old, default = manifest.batched, manifest.default_variant
    layout = S.KV_ROWWISE if default and S.split_variant(default)[1] == S.KV_ROWWISE else S.KV_STATIC
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
    src_sha = _sha256(folder / rec.file)
    same_source = (
        old.get("variant") == target
        and old.get("source_sha256") == src_sha
        and old.get("graph_version") == S.BATCHED_GRAPH_VERSION
        and old.get("gate", {}).get("machine") == machine
    )
    with step(f"batched serving graph of {target} (requests side by side, each as alone)"):
        try:
            to_batch = to_serve_batch_rowwise if layout == S.KV_ROWWISE else to_serve_batch
            proto = to_batch(onnx.load(str(folder / rec.file)), rec.file)
        except ContractError as e:  # a graph the pass does not apply to: the build goes on without it
            manifest.batched = {"skipped": f"the batch pass does not apply to {target}: {e}"}
            logger.info("  no batched serving graph: %s", manifest.batched["skipped"])
            return
        path.unlink(missing_ok=True)  # a new file: a carried (linked) one is never written through
        save_model(proto, path)
        sha = _sha256(path)
        if same_source and sha == old.get("sha256"):
            gate = old["gate"]
            logger.info("  rewritten byte for byte (sha256 %s…): its gate holds", sha[:12])
        else:
            sess, declared = sessions[target]
            try:
                gate = gate_serve_batch(Decoder(sess, declared, embed), path, threads)
            except Exception as e:  # noqa: BLE001 - a graph onnxruntime cannot run fails its gate, named
                gate = {"passed": False, "error": " ".join(str(e).split())[:300], "mismatches": 0, "steps_checked": 0}
            gate["machine"] = machine
    manifest.batched = {
        "variant": target,
        "layout": layout,
        "file": path.name,
        "bytes": path.stat().st_size,
        "sha256": sha,
        "source_sha256": src_sha,
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


def _row_guard(folder: Path, manifest: Manifest, v: str, contract, threads: int) -> None:
    """Measure every op of variant ``v`` for row invariance on this machine (export.exactness) and
    guard the ops that need two rows (export.passes.row_guard), so the graph is length-invariant
    by construction where its ops allow: a lone token then runs as one graph row, in our runtime or
    any other. Attention above head size 128 gets its key floor first (export.passes.key_floor), so
    a step's row count never changes how the kernel reduces a head. The static flavour is left as
    it is: GroupQueryAttention's lone row differs from its multi-row one whatever the pad, so its
    runtime pads a lone token instead (its key floor is part of the graph: static_kv)."""
    import onnx

    from ..export.exactness import probe
    from ..export.exporter import save_model
    from ..export.passes.key_floor import KEY_FLOOR, floor_keys, needs_key_floor
    from ..export.passes.row_guard import guard_rows

    precision, layout = S.split_variant(v)
    rec = manifest.variants.get(v) or manifest.variants.setdefault(v, VariantRecord(file=variant_file(v)))
    if rec.row_guard:  # carried from an earlier build (quant-only): measured and guarded there
        return
    if layout == S.KV_STATIC:
        rec.row_guard = {"length_invariant": False, "why": "GroupQueryAttention: lone tokens are padded by the runtime"}
        return
    path = folder / variant_file(v)
    with step(f"row invariance of {v}, per op, on this CPU"):
        proto = onnx.load(str(path))
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


def _calibrate(folder: Path, manifest: Manifest, sessions: dict[str, tuple], threads: int, embed=None) -> None:
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
        sha = _sha256(folder / rec.file)
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


@contextmanager
def _unguarded(path: Path, needed: bool):
    """``path`` as the quantizer must read it: without a row guard (guard_rows is applied last, per
    variant, after measuring it). A guarded fp32 export (a quant-only of a guarded build) is written
    unguarded to a temporary file beside it, removed afterwards."""
    import onnx

    from ..export.exporter import save_model
    from ..export.passes.row_guard import strip_row_guard

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


_hashed: dict[tuple, str] = {}


def _sha256(path: Path) -> str:
    """sha256 of a file, hashed once per version of it (path, inode, size, mtime): the byte-identity
    check, the calibration key and the manifest all ask for the same files' digests."""
    st = path.stat()
    key = (str(path), st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _hashed:
        _hashed[key] = S.sha256_file(path)
    return _hashed[key]


def static_capacity(max_context: int | None, max_positions: int) -> int:
    """The static KV buffer's length: --max-context, else the model's limit capped at
    DEFAULT_MAX_CONTEXT (pages are only touched as a context grows; sizes: docs/runtime.md)."""
    if max_context:
        return int(max_context)
    return int(min(max_positions or S.DEFAULT_MAX_CONTEXT, S.DEFAULT_MAX_CONTEXT))


_LAYOUT_STEPS = {
    S.KV_STATIC: "static KV flavour of {p} (GroupQueryAttention, capacity {c})",
    S.KV_ROWWISE: "rowwise KV flavour of {p} (one-row attention in place, capacity {c})",
}


def _layout_variant(folder: Path, manifest: Manifest, precision: str, capacity: int, layout: str) -> bool:
    """``<precision>-<layout>``: an in-place KV flavour of an already written variant file. False
    when the graph has no such flavour (said once; the build goes on without it)."""
    import onnx

    from ..export.exporter import save_model
    from ..export.passes.rowwise_kv import to_rowwise_kv
    from ..export.passes.static_kv import to_static_kv

    name = S.variant_name(precision, layout)
    rewrite = {S.KV_STATIC: to_static_kv, S.KV_ROWWISE: to_rowwise_kv}[layout]
    with step(_LAYOUT_STEPS[layout].format(p=precision, c=capacity)):
        try:
            proto = rewrite(onnx.load(str(folder / variant_file(precision))), capacity)
        except ExportError as e:
            if layout == S.KV_STATIC:
                raise
            logger.info("  no %s flavour for this model: %s", layout, e)
            return False
        save_model(proto, folder / variant_file(name))
    base = manifest.variants.get(precision)
    manifest.variants[name] = VariantRecord(
        file=variant_file(name), quant=dict(base.quant) if base else {}, kv_layout=layout, kv_capacity=capacity
    )
    return True


def _failed(rec: VariantRecord) -> str:
    return ", ".join(
        f"{k}={json.dumps({x: y for x, y in g.items() if x != 'passed'})}"
        for k, g in rec.gates.items()
        if not g.get("passed")
    )


# A faster variant displaces the preferred (smallest) one only when it is faster in EVERY
# interleaved round by more than this, or by three times the rounds' own spread if that is larger.
MIN_SPEEDUP = 0.10
# Layout preference at equal precision: rowwise decodes a single token as one row (static pays a
# pad row, concat also copies its cache); timing can still displace it by the rule below.
PREFERRED_LAYOUTS = (S.KV_ROWWISE, S.KV_STATIC, S.KV_CONCAT)


def keeps_answers(variant: str, rec: VariantRecord) -> bool:
    """The variant's quality gate meets its precision's default floors (precisions.Precision:
    default_top1, default_mean_kl): what a default must keep of the model, whatever its size or
    speed; one under them passes its own gate and can be asked for, but is not the default. fp32,
    the reference, has no quality gate: it does."""
    q = rec.gates.get("quality")
    p = P.PRECISIONS.get(S.split_variant(variant)[0])
    top1, kl = (p.default_top1, p.default_mean_kl) if p else (P.DEFAULT_TOP1, P.DEFAULT_MEAN_KL)
    return q is None or (q["top1"] >= top1 and q["mean_kl"] <= kl)


def _default_floors_line() -> str:
    """The default floors as the default's rule states them: one pair when every quantized
    precision has the same (today's table), else each precision's."""
    quantized = [p for p in P.PRECISIONS.values() if not p.reference]
    pairs = {(p.default_top1, p.default_mean_kl) for p in quantized}
    if len(pairs) == 1:
        top1, kl = pairs.pop()
        return f"top-1 >= {top1}, mean KL <= {kl}"
    return "; ".join(f"{p.name}: top-1 >= {p.default_top1}, mean KL <= {p.default_mean_kl}" for p in quantized)


def _candidates(manifest: Manifest) -> tuple[dict[str, VariantRecord], list[str], dict[str, str]]:
    """What the default is chosen among (and so what is timed), the passing variants that keep the
    model's answers, and why each other variant is not a candidate. Quality first: only variants
    that passed every gate, and of those the ones that keep the model's answers (keeps_answers;
    all passing ones if none does). fp32 (the reference, several times the size of a quantized
    file) is a candidate only where no quantized variant keeps the answers."""
    why: dict[str, str] = {}
    passing = {n: r for n, r in manifest.variants.items() if r.passed}
    for n in manifest.variants:
        if n not in passing:
            why[n] = "failed its gates"
    below = [n for n, r in passing.items() if not keeps_answers(n, r)]
    keep = {n: r for n, r in passing.items() if n not in below} or passing
    if keep is not passing:
        why.update(dict.fromkeys(below, "under the default floors"))
    cands = keep
    if any(S.split_variant(n)[0] != S.FP32 for n in keep):
        cands = {n: r for n, r in keep.items() if S.split_variant(n)[0] != S.FP32}
        why.update(
            dict.fromkeys(
                (n for n in keep if n not in cands), "the fp32 reference: a quantized variant keeps the answers"
            )
        )
    return cands, sorted(keep), why


def _preference(manifest: Manifest, cands: dict[str, VariantRecord]):
    """The candidates' order before timing: smallest precision, then rowwise, static, concat."""

    def pref(n: str):
        precision, layout = S.split_variant(n)
        size = (manifest.variants.get(precision) or cands[n]).bytes or 0
        return (size, PREFERRED_LAYOUTS.index(layout), n)

    return pref


def _settled(per_round: dict[str, list[float]], first: str) -> bool:
    """No further timing round can change the default: every other candidate was already, in some
    round, not faster than ``first`` by MIN_SPEEDUP (the least margin the picker ever asks for, in
    every round), so it can never be 'clearly faster' whatever later rounds measure."""
    base = per_round.get(first, [])
    return all(any(a >= (1 - MIN_SPEEDUP) * b for a, b in zip(x, base)) for n, x in per_round.items() if n != first)


def _choose_default(manifest: Manifest) -> tuple[str | None, dict]:
    """The default variant and why, among the candidates (_candidates: passing, keeping the
    answers, quantized before fp32). The smallest precision, rowwise then static layout first --
    what a user keeps. A larger one replaces it only where interleaved timing shows it faster in
    every round by more than max(MIN_SPEEDUP, 3 x the measured noise), so load cannot flip the
    choice. Untimed (--no-timing): the smallest passing file."""
    if not any(r.passed for r in manifest.variants.values()):
        return None, {"rule": "no variant passed its gates"}
    passing, keep, not_candidates = _candidates(manifest)
    below = sorted(n for n, r in manifest.variants.items() if r.passed and not keeps_answers(n, r))
    pref = _preference(manifest, passing)
    first = min(passing, key=pref)
    why: dict = {
        "rule": f"passing variants that keep the model's answers ({_default_floors_line()} against fp32), quantized "
        "before the fp32 reference, smallest precision and in-place layout (rowwise, then static) "
        f"preferred; a larger one only if faster in every interleaved round by more than max({MIN_SPEEDUP:.0%}, 3x noise)",
        "preferred": first,
        "passing": keep,
        "candidates": sorted(passing),
        "not_candidates": dict(sorted(not_candidates.items())),
        "below_default_floors": below,
    }
    rounds = {n: r.timing_rounds_ms for n, r in passing.items()}
    if not all(rounds.values()) or len({len(x) for x in rounds.values()}) != 1:
        smallest = min(passing, key=lambda n: (passing[n].bytes or 0, n))
        why.update(preferred=smallest, timing="not timed: the smallest passing file")
        return smallest, why
    noise = max((max(x) - min(x)) / float(np.median(x)) for x in rounds.values())
    margin = max(MIN_SPEEDUP, 3 * noise)
    faster = [n for n in passing if n != first and all(a < (1 - margin) * b for a, b in zip(rounds[n], rounds[first]))]
    pick = min(faster, key=lambda n: (float(np.median(rounds[n])), pref(n))) if faster else first
    why.update(
        noise=round(noise, 4),
        margin=round(margin, 4),
        rounds=len(rounds[first]),
        median_cost_ms={n: round(float(np.median(x)), 3) for n, x in rounds.items()},
        clearly_faster=sorted(faster),
    )
    return pick, why


def _pick_default(manifest: Manifest) -> str | None:
    return _choose_default(manifest)[0]


def _finish(folder: Path, manifest: Manifest, steps: list[tuple[str, float]] | None = None) -> None:
    if steps is not None:
        manifest.steps = [[name, sec] for name, sec in steps]
    for rec in manifest.variants.values():
        f = folder / rec.file
        rec.bytes = f.stat().st_size
        rec.sha256 = _sha256(f)
    record_files(folder, manifest)
    write_json(folder / S.MANIFEST_FILE, manifest.to_json())
    _summary(manifest)


def _summary(manifest: Manifest) -> None:
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
            else:
                parts.append(f"{m} batched=incremental {r['total'] - r['mismatches']}/{r['total']}")
        g = rec.row_guard
        if g:
            parts.append(
                f"lone token = 1 row ({g.get('guarded_nodes', 0)} ops guarded)"
                if rec.length_invariant
                else "lone token padded"
                + (f" ({', '.join(g['not_exact'])} not row-exact)" if g.get("not_exact") else "")
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
            how = f"faster than {why['preferred']} in every one of {why['rounds']} interleaved rounds by > {why['margin']:.0%}"
        elif "margin" in why:
            how = (
                f"the smallest passing variant; nothing faster by > {why['margin']:.0%} in every round "
                f"(noise {why['noise']:.1%}, {why['rounds']} interleaved rounds)"
            )
        else:
            how = "the smallest passing file (not timed)"
        logger.info(" default %s: %s", manifest.default_variant, how)
        if why.get("timed"):
            skip = why.get("not_candidates") or {}
            logger.info(
                " timed %s%s",
                ", ".join(why["timed"]),
                f"; not timed, as no default: {', '.join(f'{v} ({w})' for v, w in skip.items())}" if skip else "",
            )
    if manifest.steps:
        total = sum(sec for _, sec in manifest.steps)
        top = sorted(manifest.steps, key=lambda x: -x[1])[:6]
        logger.info(" time %.0fs: %s", total, ", ".join(f"{n.split(' (')[0]} {sec:.0f}s" for n, sec in top))
