"""`dejavuu-build bench --contexts 256,1024,...`: plain decoding speed and host overhead against context length.

For each context N the prompt is Spec-Bench text (every turn of every prompt, in file order,
joined by blank lines) tokenized by our tokenizer and cut to exactly N ids, so every system sees
the same N ids. Each context runs our plain decoding (method ``baseline``) and, with
``--compare genai`` (its int4 build) and/or ``genai-int8`` (its 8-bit build, which keeps the
model's answers as our default does), genai's plain generator on each build, back to back
(``--repeats`` rounds over all contexts; medians are reported). Both decode exactly ``--max-new-tokens`` tokens (EOS is ignored:
a fixed number of decode steps at a known context).

Per-step host overhead is decode time not spent inside onnxruntime's run:

* ours: ``GenerationStats.host_ms_per_step`` = (decode_s - forward_s) / steps, measured inside
  the same generation;
* genai: its API exposes no forward time, so after its timed generation a second one runs with
  its graph replayed under plain onnxruntime beside it, alternating in 16-step blocks
  (:func:`.genai.genai_host_estimate`: same tokens, same shapes, its shared past/present
  buffer, same thread count); genai's step j is paired with the replay's run of step j, and host
  overhead is the median over steps of (genai step - replay run). Blocks keep a shared machine's
  load drift out of the pairs without the two sessions' thread pools interfering step by step; it
  is still an estimate from two runs and can come out slightly negative. The mean of the
  differences is recorded too (``host_ms_mean``), and the replay's argmax agreement with genai's
  tokens as a check that the shapes are right.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterable, Sequence

from ..log import logger, progress
from ..machine import describe, run_facts
from ..runtime.settings import DecodeSettings
from .anatomy import Anatomy
from .config import SWEEP_PEERS, BenchConfig, BenchError, read_prompts, resolve_data
from .oracle import RowProbe
from .peer import column
from .runner import WARMUP_TOKENS

OURS = "baseline"
VERIFY = "verify"  # ours, every step verifying a fixed number of graph rows (--verify-rows)
SWEEP_FILES = {"csv": "sweep.csv", "json": "sweep.json", "png": "sweep.png", "records": "sweep_records.jsonl"}


def sweep_texts(prompts) -> Iterable[str]:
    for p in prompts:
        yield from p.turns


def sweep_prompt(encode: Callable[[str], list[int]], texts: Iterable[str], n: int, sep: str = "\n\n") -> list[int]:
    """Exactly ``n`` token ids: the texts joined by ``sep``, tokenized as one text, cut to ``n``.

    Texts are added until the whole tokenizes to at least ``n`` ids (tokenizing the joined text,
    not pieces, so the ids are what the tokenizer gives that text).
    """
    if n < 1:
        raise BenchError("a context length must be at least 1")
    joined = ""
    for t in texts:
        joined = f"{joined}{sep}{t}" if joined else t
        if len(joined) >= n // 4:  # skip tokenizing while the text is clearly too short
            ids = encode(joined)
            if len(ids) >= n:
                return ids[:n]
    if joined and len(ids := encode(joined)) >= n:
        return ids[:n]
    raise BenchError(f"the data holds too little text for a {n}-token context: pass a larger --data file")


@dataclass
class SweepRow:
    context: int
    system: str  # baseline (ours, plain decoding) | verify | a genai peer: genai, genai-int8
    runs: int
    prompt_tokens: int
    tokens: int  # new tokens per run
    decode_tok_s: float  # median over runs
    step_ms: float  # median decode time per step
    forward_ms_per_step: float | None  # inside onnxruntime's run (genai: the plain-ORT replay)
    host_ms_per_step: float | None  # step_ms - forward_ms_per_step (None: not measurable)
    prefill_ms: float
    x_genai: float | None  # decode tok/s over genai's (int4 build) at this context
    match_pct: float | None  # a genai peer: % of tokens equal to ours (informational)
    note: str = ""
    rows: int = 1  # graph rows per decode step (verify: R; ours plain: 2 on padded decoders)
    x_plain_forward: float | None = None  # verify: forward ms per step over our plain decoding's, same context
    rows_mean: float | None = None  # verify: 1 + drafted tokens per step, as run (the last steps draft less)
    x_genai_int8: float | None = None  # decode tok/s over genai's 8-bit build's (every SWEEP_PEERS has its x_ field)


@dataclass
class SweepReport:
    rows: list[SweepRow]
    files: dict
    anatomy: Anatomy | None = None  # --anatomy: the step's op profile (bench.anatomy)

    def row(self, context: int, system: str, rows: int | None = None) -> SweepRow | None:
        return next(
            (r for r in self.rows if r.context == context and r.system == system and (rows is None or r.rows == rows)),
            None,
        )

    def table(self) -> str:
        peers = [p for p in SWEEP_PEERS if any(getattr(r, column(p)) is not None for r in self.rows)] or ["genai"]
        head = (
            f"{'context':>7} {'system':<10} {'rows':>4} {'n':>2} {'decode tok/s':>12} "
            + "".join(f"{'× ' + p:>13}" for p in peers)
            + f" {'step ms':>8} {'forward ms':>10} {'× plain fwd':>11} {'host ms/step':>12} {'prefill ms':>10} {'match':>6}"
        )
        lines = [head, "-" * len(head)]
        for r in self.rows:

            def f(v, fmt):
                return "-" if v is None else format(v, fmt)

            xs = "".join(
                f"{f(getattr(r, column(p)), '.2f') + ('x' if getattr(r, column(p)) is not None else ''):>13}"
                for p in peers
            )
            lines.append(
                f"{r.context:>7} {r.system:<10} {r.rows:>4} {r.runs:>2} {r.decode_tok_s:>12.1f}{xs} {r.step_ms:>8.2f} "
                f"{f(r.forward_ms_per_step, '.2f'):>10} "
                f"{f(r.x_plain_forward, '.2f') + ('x' if r.x_plain_forward is not None else ''):>11} "
                f"{f(r.host_ms_per_step, '.3f'):>12} "
                f"{r.prefill_ms:>10.1f} {f(r.match_pct, '.0f') + ('%' if r.match_pct is not None else ''):>6}"
            )
        notes = sorted({r.note for r in self.rows if r.note})
        extra = ["", self.anatomy.table()] if self.anatomy is not None else []
        return "\n".join(lines + [f"note: {n}" for n in notes] + extra)


def _med(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def summarize(records: Sequence[dict]) -> list[SweepRow]:
    """One row per (context, system, rows) from per-run records, medians over runs."""
    rows: list[SweepRow] = []
    contexts = sorted({r["context"] for r in records})
    peers = list(dict.fromkeys(r["system"] for r in records if r["system"] not in (OURS, VERIFY)))
    for c in contexts:
        rates: dict[str, float] = {}
        kinds = (
            [(OURS, None)]
            + [(p, None) for p in peers]
            + [(VERIFY, n) for n in sorted({r["rows"] for r in records if r["context"] == c and r["system"] == VERIFY})]
        )
        for system, n_rows in kinds:
            rs = [
                r
                for r in records
                if r["context"] == c and r["system"] == system and (n_rows is None or r["rows"] == n_rows)
            ]
            if not rs:
                continue
            fwd = [r["forward_ms_per_step"] for r in rs if r.get("forward_ms_per_step") is not None]
            step = [r["decode_s"] / r["steps"] for r in rs if r["steps"]]
            host = [r["host_ms_per_step"] for r in rs if r.get("host_ms_per_step") is not None]
            row = SweepRow(
                context=c,
                system=system,
                runs=len(rs),
                prompt_tokens=rs[0]["prompt_tokens"],
                tokens=rs[0]["tokens"],
                decode_tok_s=_med([r["decode_tok_s"] for r in rs]),
                step_ms=1e3 * _med(step),
                forward_ms_per_step=_med(fwd) if fwd else None,
                host_ms_per_step=_med(host) if host else None,
                prefill_ms=1e3 * _med([r["prefill_s"] for r in rs]),
                x_genai=None,
                match_pct=_med([r["match_pct"] for r in rs]) if system in peers else None,
                note=next((r["note"] for r in rs if r.get("note")), ""),
                rows=rs[0].get("rows", 1),
                rows_mean=_med([1 + r["drafted"] / r["steps"] for r in rs if r["steps"]]) if system == VERIFY else None,
            )
            if system in peers:
                rates[system] = row.decode_tok_s
            rows.append(row)
        here = [row for row in rows if row.context == c]
        plain = next((row for row in here if row.system == OURS), None)
        for row in here:
            for p, rate in rates.items():
                if rate and row.system != VERIFY and p in SWEEP_PEERS:
                    setattr(row, column(p), row.decode_tok_s / rate)
            if row.system == VERIFY and plain is not None and plain.forward_ms_per_step and row.forward_ms_per_step:
                row.x_plain_forward = row.forward_ms_per_step / plain.forward_ms_per_step
    return rows


def _ours_record(context: int, rep: int, res, system: str = OURS, rows: int = 1) -> dict:
    s = res.stats
    return {
        "context": context,
        "system": system,
        "rows": rows,
        "repeat": rep,
        "prompt_tokens": s.prompt_tokens,
        "tokens": s.tokens,
        "drafted": s.drafted,
        "accepted": s.accepted,
        "steps": s.steps,
        "prefill_s": s.prefill_s,
        "decode_s": s.decode_s,
        "forward_s": s.forward_s,
        "forward_ms_per_step": 1e3 * s.forward_s / s.steps if s.steps else None,
        "decode_tok_s": s.decode_tok_s,
        "host_ms_per_step": s.host_ms_per_step if s.steps else None,
        "ids": list(res.tokens),
    }


def _genai_record(
    context: int, rep: int, res, est: dict | None, ours: Sequence[int], note: str, system: str = "genai"
) -> dict:
    est = est or {}
    same = 0
    for a, b in zip(res.tokens, ours):
        if a != b:
            break
        same += 1
    return {
        "context": context,
        "system": system,
        "rows": 1,
        "repeat": rep,
        "prompt_tokens": res.prompt_tokens,
        "tokens": len(res.tokens),
        "steps": res.steps,
        "prefill_s": res.prefill_s,
        "decode_s": res.decode_s,
        "forward_ms_per_step": est.get("forward_ms_per_step"),
        "decode_tok_s": res.decode_tok_s,
        "host_ms_per_step": est.get("host_ms_per_step"),
        "host_ms_mean": est.get("host_ms_mean"),
        "estimate_step_ms": est.get("genai_step_ms"),
        "replay_argmax_agree": est.get("argmax_agree"),
        "replay_tokens": est.get("tokens"),
        "match_pct": 100.0 * same / max(len(res.tokens), len(ours), 1),
        "note": note,
        "ids": list(res.tokens),
    }


VERIFY_NOTE = (
    "verify rows R: a generation whose every step verifies R graph rows (R-1 drafted ids of the context, "
    "rarely accepted: oracle.RowProbe; the last R-1 steps draft fewer, see rows_mean); forward ms per step "
    "inside onnxruntime's run, x_plain_forward = over plain decoding's at the same context"
)
HOST_NOTE = (
    "genai forward/host ms: a second genai generation alternating in 16-step blocks with a plain-onnxruntime "
    "replay of its own graph (same tokens, same shapes, shared KV buffer, same threads); host = median over "
    "steps of (genai step - replay run): an estimate"
)


def run_sweep(cfg: BenchConfig, out) -> SweepReport:
    """Time plain decoding at each of ``cfg.contexts`` (and genai's, with ``cfg.compare``) into ``out``."""
    from ..runtime import load

    if not cfg.contexts:
        raise BenchError("no contexts to sweep: pass --contexts 256,1024,...")
    if cfg.compare:
        from .genai import require_genai

        require_genai()
    out = Path(out).expanduser()
    if (out / SWEEP_FILES["json"]).is_file():
        raise BenchError(f"{out} already holds a sweep: pass another --out")
    if any(m != OURS for m in cfg.methods):
        logger.debug(
            "the context sweep times plain decoding only: ignoring --methods %s",
            ",".join(m for m in cfg.methods if m != OURS),
        )
    data = resolve_data(cfg.data)
    model = load(cfg.model, variant=cfg.variant, threads=cfg.threads)
    if model.tokenizer is None:
        raise BenchError(f"{cfg.model} has no tokenizer: the sweep builds its prompts from text")
    peers: list = []  # (genai peer, its graph's replay or None), in --compare order
    if cfg.compare:  # genai's builds only (BenchConfig refuses another peer with --contexts)
        from .genai import PRECISION_OF, GenaiReplay, load_genai_peer

        if model.manifest is None:
            raise BenchError(f"--compare needs a build with a manifest (its source); {model.folder} has none")
        for kind in cfg.compare:
            peer, _ = load_genai_peer(
                model.manifest, cfg.threads, model.eos_ids, precision=PRECISION_OF[kind]
            )  # None: said why
            if peer is None:
                continue
            replay = None
            try:
                replay = GenaiReplay(peer.folder, cfg.threads)
            except Exception as e:  # noqa: BLE001 - the estimate is optional, the timing is not
                logger.warning(
                    "%s host overhead n/a: onnxruntime cannot load its graph alone (%s)", peer.name, str(e)[:200]
                )
            peers.append((peer, replay))
    contexts = []
    for c in dict.fromkeys(cfg.contexts):
        limits = [(model.contract.max_positions, "the model's positions")]
        limits += [(peer.context_length, f"{peer.name}'s context length") for peer, _ in peers]
        room = cfg.max_new_tokens + max(cfg.verify_rows, default=1)
        over = [why for lim, why in limits if lim and c + room > lim]
        if over:
            logger.warning("context %d + %d new tokens exceeds %s: skipped", c, cfg.max_new_tokens, " and ".join(over))
        else:
            contexts.append(c)
    if not contexts:
        raise BenchError("no context fits the model: lower --contexts or --max-new-tokens")
    texts = list(sweep_texts(read_prompts(data)))
    encode = lambda t: model.tokenizer.encode(t, add_special_tokens=False)  # noqa: E731
    prompts = {c: sweep_prompt(encode, texts, c) for c in contexts}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg.to_json(), indent=2) + "\n")
    facts = run_facts()
    logger.info(
        "context sweep %s (%s): contexts %s × %d run(s), %d new tokens%s%s, into %s, on %s",
        cfg.model,
        model.variant,
        ",".join(map(str, contexts)),
        cfg.repeats,
        cfg.max_new_tokens,
        f", verify steps of {','.join(map(str, cfg.verify_rows))} rows" if cfg.verify_rows else "",
        f" vs {', '.join(p.name for p, _ in peers)}" if peers else "",
        out,
        describe(facts),
    )
    records: list[dict] = []
    eos = model.eos_ids
    model.eos_ids = []  # a fixed number of decode steps
    try:
        warm = prompts[contexts[0]][:64]
        model.generate(warm, DecodeSettings(max_new_tokens=min(WARMUP_TOKENS, cfg.max_new_tokens)))
        for peer, _ in peers:
            peer.generate(warm, min(WARMUP_TOKENS, cfg.max_new_tokens), ignore_eos=True)
        jobs = [(rep, c) for rep in range(cfg.repeats) for c in contexts]
        with (out / SWEEP_FILES["records"]).open("w", encoding="utf-8") as fh:
            for rep, c in progress(jobs, "sweep", total=len(jobs)):
                plain = DecodeSettings(max_new_tokens=cfg.max_new_tokens)  # greedy: a fixed number of steps
                res = model.generate(prompts[c], plain)
                recs = [_ours_record(c, rep, res, rows=model.decoder.single_rows)]
                for n in cfg.verify_rows:
                    probe = model.generate(
                        prompts[c], replace(plain, method=RowProbe(n - 1), max_nodes=n - 1, max_depth=n - 1)
                    )
                    recs.append(_ours_record(c, rep, probe, VERIFY, n))
                for peer, replay in peers:
                    g = peer.generate(prompts[c], cfg.max_new_tokens, ignore_eos=True)
                    est, note = None, HOST_NOTE
                    if replay is None:
                        note = "genai host overhead n/a: onnxruntime could not load genai's graph alone"
                    else:
                        try:
                            from .genai import genai_host_estimate

                            est = genai_host_estimate(peer, replay, prompts[c], cfg.max_new_tokens)
                        except Exception as e:  # noqa: BLE001 - the estimate is optional, the timing is not
                            note = f"genai host overhead n/a: its graph did not replay under plain onnxruntime ({e})"
                            logger.warning(note[:300])
                    recs.append(_genai_record(c, rep, g, est, res.tokens, note[:300], peer.name))
                fh.write("".join(json.dumps(r) + "\n" for r in recs))
                fh.flush()
                records += recs
        anatomy = None
        if cfg.anatomy:
            from .anatomy import run_anatomy

            logger.info(
                "step anatomy at context %d: profiling ours%s",
                contexts[0],
                "".join(f" and {p.name}'s graph" for p, _ in peers),
            )
            anatomy = run_anatomy(
                model,
                prompts[contexts[0]],
                out,
                [(p.name, p.folder) for p, _ in peers],
                {"model_folder": str(model.folder), "model_variant": model.variant},
            )
    finally:
        model.eos_ids = eos
    report = SweepReport(summarize(records), {}, anatomy)
    meta = {
        "config": cfg.to_json(),
        "machine": facts,
        "model_folder": str(model.folder),
        "model_variant": model.variant,
        "data": str(data),
        "prompt": "Spec-Bench turns in file order joined by blank lines, our tokenizer "
        "(no special tokens), cut to exactly N ids; EOS ignored",
        "host_overhead": {
            "baseline": "GenerationStats.host_ms_per_step: (decode_s - forward_s) / steps, same generation",
            **{p.name: HOST_NOTE for p, _ in peers},
        },
        "verify": VERIFY_NOTE if cfg.verify_rows else None,
        "peers": {p.name: p.describe() for p, _ in peers},
    }
    write_sweep(report, out, meta)
    if anatomy is not None:
        report.files.update({f"anatomy_{k}": v for k, v in anatomy.files.items()})
    return report


def write_sweep(report: SweepReport, out: Path, meta: dict) -> dict:
    from .report import write_rows

    paths = {k: out / v for k, v in SWEEP_FILES.items()}
    write_rows(paths, report.rows, SweepRow, meta)
    try:
        plot_sweep(
            report,
            paths["png"],
            title=f"{Path(meta['model_folder']).name} ({meta['model_variant']}): plain decoding vs context",
        )
    except ImportError:
        logger.warning("matplotlib is not installed: no %s (pip install matplotlib)", paths["png"].name)
        del paths["png"]
    report.files = paths
    return paths


def plot_sweep(report: SweepReport, path: Path, title: str) -> None:
    """Panels against context: decode tok/s, forward ms per step, host ms per step; with verify
    rows, a fourth: forward ms per step against graph rows, one line per context."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (
        ("decode_tok_s", "decode tok/s"),
        ("forward_ms_per_step", "forward ms per step (inside ORT run)"),
        ("host_ms_per_step", "host ms per step (all but the forward)"),
    )
    verify = [r for r in report.rows if r.system == VERIFY]
    fig, axes = plt.subplots(1, 4 if verify else 3, figsize=(18 if verify else 14, 4))
    from .peer import KINDS

    lines = [(OURS, "ours (baseline)", "C0")] + [
        (p, KINDS[p].label, f"C{i}") for i, p in enumerate(SWEEP_PEERS, start=1)
    ]
    for system, label, color in lines:
        rows = [r for r in report.rows if r.system == system]
        for ax, (key, _) in zip(axes, panels):
            pts = [(r.context, getattr(r, key)) for r in rows if getattr(r, key) is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", color=color, label=label)
    contexts = sorted({r.context for r in report.rows})
    for ax, (_key, ylabel) in zip(axes, panels):
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts, [str(c) for c in contexts])
        ax.minorticks_off()
        ax.set_xlabel("context (prompt tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.axhline(0, color="black", linewidth=0.5)
        if ax.has_data():
            ax.legend(fontsize=8)
    axes[0].set_ylim(bottom=0)
    if verify:
        ax = axes[3]
        for i, c in enumerate(contexts):
            by_rows = sorted(
                (r.rows_mean or r.rows, r.forward_ms_per_step)
                for r in report.rows
                if r.context == c and r.system in (OURS, VERIFY) and r.forward_ms_per_step is not None
            )
            if by_rows:
                ax.plot(*zip(*by_rows), marker="o", color=f"C{i}", label=f"context {c}")
        ax.set_xlabel("graph rows per step (1 + drafted tokens)")
        ax.set_ylabel("ours: forward ms per step")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
