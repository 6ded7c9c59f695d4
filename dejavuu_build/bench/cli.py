"""`dejavuu-build bench`: a thin Click shell over :func:`dejavuu_build.bench.runner.run_bench`."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from .. import schema as S
from ..log import logger
from ..runtime.cli import friendly as _friendly
from ..runtime.drafters import DraftBudget
from .config import DEFAULT_CATEGORIES, NGRAM_OFF, NGRAM_SWEEP, PEERS, BenchConfig, BenchError
from .peer import KINDS
from .runner import ExactnessError, run_bench


def _csv(value: str | None) -> tuple[str, ...]:
    return tuple(v.strip() for v in (value or "").split(",") if v.strip())


def _ints(value: str | None, option: str = "--contexts", example: str = "256,1024") -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in _csv(value))
    except ValueError:
        raise BenchError(f"{option} takes comma-separated whole numbers, e.g. {example} (got {value!r})") from None


def _out_dir(model: str, out: str | None, resume: str | None, kind: str = "") -> tuple[Path, bool]:
    """(out folder, resuming?) from --out and --resume [DIR]."""
    from ..cache import cache_root

    if resume is not None:
        if resume and out and Path(resume).expanduser().resolve() != Path(out).expanduser().resolve():
            raise BenchError(f"--resume {resume} and --out {out} name different folders: give one")
        if not (resume or out):
            raise BenchError("--resume needs the run's folder: --resume DIR, or --resume with --out DIR")
        return Path(resume or out or "").expanduser(), True  # one of them is given (checked above)
    if out:
        return Path(out).expanduser(), False
    stem = Path(model).name if Path(model).expanduser().exists() else model
    return cache_root() / S.BENCH_DIR / f"{stem}{kind}-{time.strftime('%Y%m%d-%H%M%S')}", False


@click.command("bench")
@click.option("--model", required=True, help="Cache name or folder of a built decoder.")
@click.option(
    "--methods",
    default="baseline,pld,suffix_decoding",
    show_default=True,
    help="Comma-separated methods; baseline (plain decoding) is always run.",
)
@click.option("--per-category", default=10, show_default=True, type=int, help="Prompts per category.")
@click.option(
    "--skip",
    default=0,
    show_default=True,
    type=int,
    help="Leave out the first N prompts of each category (held-out prompts: the default set is what "
    "the drafters were tuned on).",
)
@click.option(
    "--categories",
    default=",".join(DEFAULT_CATEGORIES),
    show_default=True,
    help="Comma-separated categories; mt_bench = Spec-Bench's 80 multi-turn MT-Bench prompts.",
)
@click.option("--max-new-tokens", default=S.DEFAULT_MAX_NEW_TOKENS, show_default=True, type=int)
@click.option("--threads", default=S.DEFAULT_THREADS, show_default=True, type=int, help="ORT intra-op threads.")
@click.option("--tree", is_flag=True, help="Verify trees of drafts instead of chains.")
@click.option(
    "--width", default=S.DEFAULT_TREE_WIDTH, show_default=True, type=int, help="Tree width (children per node)."
)
@click.option("--variant", default=None, help="fp32 | int8 | int4 [default: the manifest's default].")
@click.option(
    "--data",
    default=None,
    type=click.Path(dir_okay=False),
    help="Spec-Bench question.jsonl [default: ../shared/data/spec_bench/question.jsonl when present].",
)
@click.option(
    "--out",
    default=None,
    type=click.Path(file_okay=False),
    help="Results folder [default: <cache>/bench/<model>-<timestamp>].",
)
@click.option(
    "--resume",
    default=None,
    is_flag=False,
    flag_value="",
    metavar="[DIR]",
    help="Continue an interrupted run in DIR (or in --out), skipping finished prompts.",
)
@click.option(
    "--temperature",
    default=0.0,
    show_default=True,
    type=float,
    help="0 = greedy, where every method must match baseline exactly.",
)
@click.option(
    "--datastore",
    default=None,
    help="Datastore (cache name or folder) for rest / sam_decoding / asam / auto "
    "[default: built in memory from the other categories' prompts].",
)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option(
    "--compare",
    default=None,
    metavar="genai,genai-int8,llamacpp",
    help="Also time other systems on the same prompt ids: genai = onnxruntime-genai's int4 CPU build of "
    'the same source (built once into <cache>/.peers; pip install -e ".[compare]"), plain and its '
    "n-gram speculative decoding ('× genai', '× genai-ngram'); genai-int8 = its int8 build, plain "
    "('× genai-int8': genai where it keeps the model's answers as our default does); llamacpp = the "
    "source GGUF in llama.cpp, plain and prompt lookup ('× llamacpp', '× llamacpp-lookup'; "
    'pip install -e ".[llamacpp]").',
)
@click.option(
    "--genai-ngram",
    default=None,
    metavar="N,K",
    help="With --compare genai: time genai's n-gram speculative decoding with ngram_size N and "
    "max_draft_tokens K [default: the best of a small sweep on prompts outside the measured set, "
    "recorded in genai_ngram_sweep.json].",
)
@click.option("--no-genai-ngram", is_flag=True, help="With --compare genai: time genai's plain decoding only.")
@click.option(
    "--contexts",
    default=None,
    metavar="N,N,...",
    help="A context sweep instead of Spec-Bench categories: plain decoding at prompts of exactly these "
    "token counts, decode tok/s and per-step host overhead (with --compare genai and/or genai-int8: "
    "genai's too, on each build).",
)
@click.option("--repeats", default=1, show_default=True, type=int, help="Context sweep: runs per context (medians).")
@click.option(
    "--verify-rows",
    default=None,
    metavar="R,R,...",
    help="Context sweep: also time verify steps of exactly R graph rows (R-1 drafted tokens) at each "
    "context: what one drafted token costs, the bound on any speculative method's speedup.",
)
@click.option(
    "--anatomy",
    is_flag=True,
    help="Context sweep: also profile a decode step at the first context by op type (nodes per step and "
    "kernel time, one thread), ours and, with --compare genai / genai-int8, each genai build's graph: "
    "anatomy.csv/json/png.",
)
@click.option(
    "--replay",
    "replay_file",
    default=None,
    type=click.Path(dir_okay=False),
    metavar="FILE",
    help="Offline replay instead of timing: each method against plain decoding's greedy answers recorded "
    "in FILE (recorded first, from --model and the prompt options, when FILE does not exist; then the first "
    "--per-category prompts of each recorded category); reports "
    "tokens per step, the speedup estimated at the row costs (draft time included) and the share of the "
    "copy oracle's gain, per category. With --out: replay.csv and replay.json there.",
)
@click.option(
    "--row-costs",
    default=None,
    metavar="C1,C2,...",
    help="With --replay: a step of 1, 2, ... graph rows as multiples of a one-row step [default: the "
    "recording's own probe].",
)
@click.option(
    "--step-ms",
    default=None,
    type=float,
    help="With --replay: a one-row step in ms, what draft time is weighed against [default: the recording's].",
)
@_friendly
def bench(
    model,
    methods,
    per_category,
    skip,
    categories,
    max_new_tokens,
    threads,
    tree,
    width,
    variant,
    data,
    out,
    resume,
    temperature,
    datastore,
    seed,
    compare,
    genai_ngram,
    no_genai_ngram,
    contexts,
    repeats,
    verify_rows,
    anatomy,
    replay_file,
    row_costs,
    step_ms,
):
    """Spec-Bench speedups per category and method, with a 100% greedy exactness gate."""
    compare_t, contexts_t = _csv(compare), _ints(contexts)
    if genai_ngram and no_genai_ngram:
        raise BenchError("--genai-ngram and --no-genai-ngram contradict each other: give one")
    if bad := [c for c in compare_t if c not in PEERS]:
        raise BenchError(f"unknown --compare {', '.join(bad)}; choose from: {', '.join(PEERS)}")
    for k in compare_t:
        KINDS[k].require()  # a missing package: one line and exit 2, before anything slow
    common = dict(  # what a replay's recording and a timed run share
        model=model,
        methods=_csv(methods),
        categories=_csv(categories),
        per_category=per_category,
        skip=skip,
        max_new_tokens=max_new_tokens,
        threads=threads,
        width=width,
        variant=variant,
        data=data,
    )
    if replay_file:
        _replay(replay_file, BenchConfig(**common), out, row_costs, step_ms)
        return
    if row_costs or step_ms is not None:
        raise BenchError("--row-costs and --step-ms go with --replay")
    if contexts_t and resume is not None:
        raise BenchError("a context sweep cannot be resumed: run it again with another --out")
    folder, resuming = _out_dir(model, out, resume, "-sweep" if contexts_t else "")
    cfg = BenchConfig(
        **common,
        tree=tree,
        temperature=temperature,
        seed=seed,
        datastore=datastore,
        compare=compare_t,
        contexts=contexts_t,
        repeats=repeats,
        verify_rows=_ints(verify_rows, "--verify-rows", "2,4,8"),
        anatomy=anatomy,
        genai_ngram=NGRAM_OFF if no_genai_ngram else (genai_ngram or NGRAM_SWEEP),
    )
    if contexts_t:
        from .sweep import run_sweep

        try:
            sweep = run_sweep(cfg, folder)
        except KeyboardInterrupt:
            click.echo(f"interrupted: finished runs are in {folder}", err=True)
            sys.exit(130)
        click.echo(sweep.table())
        click.echo("results: " + ", ".join(str(p) for p in sweep.files.values()))
        return
    try:
        report = run_bench(cfg, folder, resume=resuming)
    except ExactnessError as e:
        if e.report is not None:
            click.echo(e.report.table())
        raise
    except KeyboardInterrupt:
        click.echo(f"interrupted: finished prompts are kept; continue with --resume {folder}", err=True)
        sys.exit(130)
    click.echo(report.table())
    click.echo("results: " + ", ".join(str(p) for p in report.files.values()))


def _replay(path, cfg: BenchConfig, out, row_costs, step_ms) -> None:
    """``bench --replay``: record FILE if it is missing (plain decoding of ``cfg``'s prompts), then
    replay ``cfg``'s methods against it."""
    from . import replay as R

    file = Path(path).expanduser()
    if file.is_file():
        rec = R.Recording.load(file)
        skipped = int(rec.meta.get("skip", 0))
        if skipped != cfg.skip:
            raise BenchError(
                f"{file} holds the prompts after the first {skipped} of each category, "
                f"not after {cfg.skip}: replay it with --skip {skipped}, or record to another file"
            )
        logger.info("replaying %d recorded turns of %s from %s", len(rec.turns), rec.model, file)
    else:
        rec = R.record(cfg, file)
    cost = None
    if row_costs:
        vals = [float(v) for v in _csv(row_costs)]
        cost = {r: max(vals[:r]) for r in range(1, len(vals) + 1)}
    turns_cats = set(t.category for t in rec.turns)
    cats = [c for c in cfg.categories if c in turns_cats] or None
    rows = R.replay(
        rec,
        list(cfg.methods),  # baseline first (BenchConfig)
        cost=cost,
        step_ms=step_ms,
        categories=cats,
        per_category=cfg.per_category,
        budget=DraftBudget(max_nodes=S.DEFAULT_MAX_DEPTH, max_depth=S.DEFAULT_MAX_DEPTH, width=cfg.width),
    )
    click.echo(R.table(rows))
    if out:
        target = R.write(rows, Path(out).expanduser() / "replay.csv", {"recording": str(file), "meta": rec.meta})
        click.echo(f"results: {target}, {target.with_suffix('.json')}")
