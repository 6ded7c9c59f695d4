"""The benchmark loop: Spec-Bench prompts, interleaved method runs, resumable records, the exactness gate.

Why it is shaped this way:

* every method of one prompt runs back to back (baseline first), so machine noise (other
  processes, thermal drift) hits all methods of that prompt alike and speedups stay fair;
* each finished prompt is appended to ``records.jsonl`` and fsynced at once, so an interrupted
  run loses at most the prompt in flight and ``resume`` redoes only what is missing;
* in greedy mode a speculative method must reproduce plain decoding token for token (that is
  what "lossless" means); any difference is a bug, so the run fails after writing its results.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

from ..log import logger, progress
from ..machine import describe, run_facts
from ..runtime.settings import DecodeSettings
from .config import (
    NGRAM_OFF,
    NGRAM_SWEEP,
    RAW_BASELINE,
    TREE_SUFFIX,
    BenchConfig,
    BenchError,
    Prompt,
    as_prompt,
    base_method,
    common_prefix,
    prompt_format,
    read_prompts,
    resolve_data,
    select,
)
from .oracle import MAX_DRAFT, measure_row_costs, runs
from .peer import KINDS, PLAIN_OF
from .report import NEVER_SLOWER, Report, aggregate, write_outputs

if TYPE_CHECKING:
    from ..runtime.model import GenerationResult, Model
    from ..runtime.tokenizer import TextTokenizer


class ExactnessError(BenchError):
    """A method's greedy output differs from plain decoding: the lossless guarantee is broken."""

    def __init__(self, message: str, failures: list[dict], report: Report | None = None):
        super().__init__(message)
        self.failures = failures
        self.report = report


RECORDS_FILE = "records.jsonl"
ROW_COSTS_FILE = "row_costs.json"  # seconds of a decode step of R graph rows, measured by the run (bench.oracle)
CONFIG_FILE = "config.json"
WARMUP_TOKENS = 8


# ---------------------------------------------------------------------------------- records
class RecordStore:
    """``records.jsonl`` in the out folder: one line per (prompt, turn, method), a prompt at a time."""

    def __init__(self, out: Path, cfg: BenchConfig, resume: bool):
        self.out = out
        self.path = out / RECORDS_FILE
        cfg_path = out / CONFIG_FILE
        if resume:
            if not cfg_path.is_file():
                raise BenchError(f"{out} holds no bench run to resume ({CONFIG_FILE} missing)")
            old = json.loads(cfg_path.read_text())
            old.setdefault("compare", [])  # runs from before --compare existed
            old.setdefault("genai_ngram", NGRAM_OFF)  # and before genai's n-gram decoding was timed
            old.setdefault("skip", 0)  # and before --skip
            new = cfg.to_json()
            diff = [k for k in cfg.RESUME_KEYS if old.get(k) != new.get(k)]
            if diff:
                raise BenchError(
                    f"cannot resume {out}: " + ", ".join(f"{k} was {old.get(k)!r}, now {new.get(k)!r}" for k in diff)
                )
        elif self.path.is_file() and self.path.stat().st_size:
            raise BenchError(f"{out} already holds a bench run: pass --resume {out} to continue it, or another --out")
        out.mkdir(parents=True, exist_ok=True)
        cfg_path.write_text(json.dumps(cfg.to_json(), indent=2) + "\n")
        self.records: list[dict] = self._load() if resume else []

    def _load(self) -> list[dict]:
        """Parsed lines; a torn last line (a crash mid-write) is cut off so appends stay valid."""
        if not self.path.is_file():
            return []
        recs: list[dict] = []
        good = 0
        with self.path.open("rb") as f:
            for line in f:
                try:
                    recs.append(json.loads(line))
                except json.JSONDecodeError:
                    break
                good += len(line)
        if good < self.path.stat().st_size:
            logger.warning("%s: dropping a torn record at byte %d", self.path, good)
            with self.path.open("r+b") as f:
                f.truncate(good)
        return recs

    def done(self, p: Prompt, methods: Sequence[str]) -> bool:
        """A prompt counts only when every (method, turn) of it was recorded."""
        want = {(m, t) for m in methods for t in range(1, len(p.turns) + 1)}
        return want <= {(r["method"], r["turn"]) for r in self.records if r["qid"] == p.qid}

    def append(self, recs: Iterable[dict]) -> None:
        recs = list(recs)
        with self.path.open("a", encoding="utf-8") as f:
            f.write("".join(json.dumps(r) + "\n" for r in recs))
            f.flush()
            os.fsync(f.fileno())
        self.records += recs

    def for_prompts(self, prompts: Sequence[Prompt], methods: Sequence[str]) -> list[dict]:
        """The latest record of each (prompt, turn, method) of this selection (a redone prompt wins)."""
        keep = {p.qid for p in prompts}
        latest = {
            (r["qid"], r["turn"], r["method"]): r for r in self.records if r["qid"] in keep and r["method"] in methods
        }
        return list(latest.values())


def make_record(
    p: Prompt, turn: int, method: str, res: GenerationResult, baseline_ids: Sequence[int], gated: bool = True
) -> dict:
    """Everything the report needs about one generation, plus its agreement with baseline."""
    s = res.stats
    common = common_prefix(res.tokens, baseline_ids)
    same = list(res.tokens) == list(baseline_ids)
    return {
        "qid": p.qid,
        "category": p.category,
        "source": p.source,
        "turn": turn,
        "method": method,
        "prompt_tokens": s.prompt_tokens,
        "tokens": s.tokens,
        "steps": s.steps,
        "drafted": s.drafted,
        "accepted": s.accepted,
        "prefill_s": s.prefill_s,
        "decode_s": s.decode_s,
        "draft_s": s.draft_s,
        "verify_s": s.verify_s,
        "kv_s": s.kv_s,
        "overhead_s": s.overhead_s,
        "total_s": s.total_s,
        "stop_reason": res.stop_reason,
        "match": same,
        "common_prefix": common,
        "compared": max(len(res.tokens), len(baseline_ids)),
        "first_mismatch": None if same else common,
        "gated": gated,
        "ids": list(res.tokens),
    }


# ---------------------------------------------------------------------------------- drafters
class DrafterPool:
    """One fresh drafter per method for the whole run, reused across its prompts, as a server would.

    Retrieval methods (``uses_datastore``: rest, sam_decoding, asam, auto) without ``--datastore``
    get one drafter per category whose in-memory datastore holds the turns of every *other*
    category's prompts, so they retrieve real text without ever seeing the prompt under test.
    """

    def __init__(self, cfg: BenchConfig, encode: Callable[[str], list[int]], corpus: Sequence[Prompt]):
        self.cfg = cfg
        self.encode = encode
        self.corpus = corpus
        self._drafters: dict[tuple[str, str | None], object] = {}
        self._stores: dict[str | None, object] = {}
        self._scoped: dict[str, bool] = {}

    def _store(self, category: str | None):
        if category not in self._stores:
            if self.cfg.datastore:
                from ..runtime.model import load_datastore

                self._stores[category] = load_datastore(self.cfg.datastore)
            else:
                from ..runtime.drafters import Datastore

                docs = (self.encode(t) for p in self.corpus if p.category != category for t in p.turns)
                self._stores[category] = Datastore.build(docs)
                logger.debug("datastore for %s: %r", category, self._stores[category])
        return self._stores[category]

    def get(self, method: str, category: str):
        """The run's drafter for ``method`` (per category for retrieval methods without --datastore)."""
        from ..runtime.drafters import make_drafter

        def make(store=None):
            try:
                return make_drafter("baseline" if method == RAW_BASELINE else base_method(method), datastore=store)
            except (TypeError, ValueError) as e:
                raise BenchError(f"method {method}: {e}") from None

        if method not in self._scoped:  # the drafter class says whether it retrieves from a datastore
            probe = make()
            self._scoped[method] = bool(getattr(probe, "uses_datastore", False))
            if not self._scoped[method]:
                self._drafters[method, None] = probe
        scope = (None if self.cfg.datastore else category) if self._scoped[method] else None
        if (method, scope) not in self._drafters:
            self._drafters[method, scope] = make(self._store(scope))
        return self._drafters[method, scope]


# ---------------------------------------------------------------------------------- the run
def _tokenizer(model: Model) -> TextTokenizer:
    """The model's tokenizer (run_bench refuses a model without one: it sends chat messages)."""
    if model.tokenizer is None:
        raise BenchError(f"{model.folder.name} has no tokenizer: the benchmark sends chat messages")
    return model.tokenizer


def prompt_fits(model: Model, p: Prompt, max_new_tokens: int) -> bool:
    """Whether the whole conversation (answers at their longest) fits the model's positions."""
    limit = model.contract.max_positions
    if not limit:
        return True
    msgs: list[dict] = []
    for t in p.turns:
        msgs += [{"role": "user", "content": t}, {"role": "assistant", "content": ""}]
    return len(model.encode(as_prompt(model, msgs[:-1]))) + len(p.turns) * max_new_tokens <= limit


def peer_record(
    p: Prompt, turn: int, res, baseline_ids: Sequence[int], method: str, plain_ids: Sequence[int] | None = None
) -> dict:
    """A peer's generation (``peer.PeerResult``) as a record: timed, compared with baseline, never gated.

    Plain decoding's steps are one forward + sampling each; a speculative peer's steps are its
    target forwards and its drafted / accepted are its own counts. The whole decode time counts as
    verify time (peers expose no split). ``plain_ids`` (the peer's own plain decoding of this turn)
    adds a speculative peer's match with it: what its drafting keeps of it.
    """
    common = common_prefix(res.tokens, baseline_ids)
    same = list(res.tokens) == list(baseline_ids)
    spec = res.speculative or {}
    rec = {
        "qid": p.qid,
        "category": p.category,
        "source": p.source,
        "turn": turn,
        "method": method,
        "prompt_tokens": res.prompt_tokens,
        "tokens": len(res.tokens),
        "steps": res.steps,
        "drafted": int(spec.get("draft_tokens_evaluated", 0)),
        "accepted": int(spec.get("draft_tokens_accepted", 0)),
        "prefill_s": res.prefill_s,
        "decode_s": res.decode_s,
        "draft_s": 0.0,
        "verify_s": res.decode_s,
        "kv_s": 0.0,
        "overhead_s": 0.0,
        "total_s": res.total_s,
        "stop_reason": res.stop_reason,
        "match": same,
        "common_prefix": common,
        "compared": max(len(res.tokens), len(baseline_ids)),
        "first_mismatch": None if same else common,
        "gated": False,
        "ids": list(res.tokens),
    }
    if res.speculative is not None:
        rec["speculative"] = res.speculative
    if plain_ids is not None:
        rec.update(
            plain_match=list(res.tokens) == list(plain_ids),
            plain_common_prefix=common_prefix(res.tokens, plain_ids),
            plain_compared=max(len(res.tokens), len(plain_ids)),
        )
    return rec


def run_peer(
    model: Model,
    peer,
    p: Prompt,
    cfg: BenchConfig,
    baseline: Sequence[Sequence[int]],
    plain: Sequence[Sequence[int]] | None = None,
) -> list[dict]:
    """The peer on ``p``: our tokenizer and chat template make the ids, the peer gets the ids.
    ``plain``: the peer's own plain decoding's tokens per turn of ``p``, for a speculative peer's
    match with them."""
    recs: list[dict] = []
    messages: list[dict] = []
    for turn, text in enumerate(p.turns, 1):
        messages.append({"role": "user", "content": text})
        res = peer.generate(model.encode(as_prompt(model, messages)), cfg.max_new_tokens)
        messages.append({"role": "assistant", "content": _tokenizer(model).decode(res.tokens)})
        recs.append(
            peer_record(p, turn, res, baseline[turn - 1], peer.name, None if plain is None else plain[turn - 1])
        )
    return recs


def run_prompt(model: Model, p: Prompt, pool: DrafterPool, cfg: BenchConfig, peers: Sequence = ()) -> list[dict]:
    """Baseline then each method on ``p``, then each peer; multi-turn prompts replay each one's own answers."""
    recs: list[dict] = []
    baseline: list[list[int]] = []
    for method in cfg.methods:
        # "<m>+tree" gets a drafter of its own: drafters that learn from earlier outputs (suffix
        # decoding's global tree) must not see the chain run's answer to this very prompt
        drafter = pool.get(method, p.category)
        settings = cfg.settings
        raw = method == RAW_BASELINE
        tree = cfg.tree or method.endswith(TREE_SUFFIX)
        messages: list[dict] = []
        for turn, text in enumerate(p.turns, 1):
            messages.append({"role": "user", "content": text})
            # every method runs as `generate` runs it for a user; only the raw reference
            # (baseline_n1) drops the pad row of a padded decoder
            with model.decoder.padding(False if raw else model.decoder.pad_single):
                res = model.generate(as_prompt(model, messages), replace(settings, method=drafter, tree=tree))
            if method == "baseline":
                baseline.append(list(res.tokens))
            rec = make_record(p, turn, method, res, baseline[turn - 1], gated=not raw)
            if method == "baseline":  # what the copy oracle could draft at each step (bench.oracle)
                rec["oracle_runs"] = runs(model.encode(as_prompt(model, messages)), res.tokens)
            messages.append({"role": "assistant", "content": res.text})
            if cfg.greedy and not rec["match"] and not raw:
                logger.error(
                    "✗ %s differs from baseline on prompt %s turn %d at token %d",
                    method,
                    p.qid,
                    turn,
                    rec["first_mismatch"],
                )
            recs.append(rec)
    own: dict[str, list[list[int]]] = {}  # a peer's plain decoding comes before its speculative one
    for peer in peers:
        try:
            got = run_peer(model, peer, p, cfg, baseline, own.get(PLAIN_OF.get(peer.name, "")))
        except BenchError as e:  # the peer refused this prompt: one line, the run goes on without it here
            logger.warning("%s skipped on prompt %s (%s): %s", peer.name, p.qid, p.category, str(e)[:400])
            continue
        own[peer.name] = [r["ids"] for r in got]
        recs += got
    return recs


@dataclass
class PeerContext:
    """What a peer kind's ``load_peers`` may use: the run, its prompts and a warm-up prompt."""

    model: Model
    cfg: BenchConfig
    out: Path
    corpus: Sequence[Prompt]
    prompts: Sequence[Prompt]
    fits: Callable[[Prompt], bool]
    resume: bool
    warmup_ids: list[int]
    warmup_tokens: int


def load_peers(ctx: PeerContext) -> list:
    """The --compare peers (``bench.peer.KINDS``), built or located from the source our build
    records, each kind's plain decoding before its speculative one; a kind that cannot run here
    said why in one line and adds none."""
    if not ctx.cfg.compare:
        return []
    if ctx.model.manifest is None:
        raise BenchError(f"--compare needs a build with a manifest (its source); {ctx.model.folder} has none")
    return [p for k in ctx.cfg.compare for p in KINDS[k].load(ctx)]


def _recorded_peers(out: Path) -> dict:
    """The peers of an earlier, resumed part of the run (nothing left to time now)."""
    try:
        return json.loads((out / "results.json").read_text()).get("peers", {})
    except (OSError, json.JSONDecodeError):
        return {}


def _vs_plain(records: Sequence[dict], method: str) -> dict:
    """A speculative peer's token match with its own plain decoding over the run: identical
    generations and tokens."""
    ng = [r for r in records if r["method"] == method and r.get("plain_compared") is not None]
    compared = sum(r["plain_compared"] for r in ng)
    return {
        "plain": PLAIN_OF[method],
        "generations": len(ng),
        "identical": sum(bool(r["plain_match"]) for r in ng),
        "match_pct": 100.0 * sum(r["plain_common_prefix"] for r in ng) / compared if compared else None,
    }


def gate_failures(records: Sequence[dict]) -> list[dict]:
    return sorted(
        (r for r in records if not r["match"] and r.get("gated", True)),
        key=lambda r: (r["method"], r["category"], r["turn"]),
    )


def _gate_message(failures: Sequence[dict], total: int, out: Path) -> str:
    first: dict[str, dict] = {}
    for r in failures:
        first.setdefault(r["method"], r)
    detail = "; ".join(
        f"{m}: prompt {r['qid']} ({r['category']}) turn {r['turn']}, first mismatch at token {r['first_mismatch']}"
        for m, r in first.items()
    )
    return (
        f"exactness gate failed: {len(failures)} of {total} greedy generations differ from baseline ({detail}); "
        f"results in {out}"
    )


def _row_costs(model: Model, out: Path, messages: list[dict] | str | None) -> dict[int, float]:
    """The run's row costs: measured now (a run starting or resumed with prompts to do), else those
    the run recorded."""
    path = out / ROW_COSTS_FILE
    if messages is None:
        try:
            return {int(k): float(v) for k, v in json.loads(path.read_text()).items()}
        except (OSError, ValueError, AttributeError):
            return {}
    costs = measure_row_costs(model, messages, rows=MAX_DRAFT + 1)
    path.write_text(json.dumps({str(r): t for r, t in costs.items()}, indent=2) + "\n")
    logger.info(
        "decode step cost by graph rows (× one row): %s",
        ", ".join(f"{r}: {t / costs[1]:.2f}" for r, t in costs.items()) if 1 in costs else "-",
    )
    return costs


def run_bench(cfg: BenchConfig, out: str | os.PathLike, *, resume: bool = False) -> Report:
    """Run (or continue) the benchmark into ``out``; returns the Report.

    Raises ExactnessError (carrying the report) after writing every output if a greedy
    generation differs from baseline.
    """
    from ..runtime import load

    if cfg.contexts:
        raise BenchError("a context sweep runs through bench.sweep.run_sweep")
    for k in cfg.compare:
        KINDS[k].require()  # a missing package: one line before any slow work
    out = Path(out).expanduser()
    data = resolve_data(cfg.data)
    corpus = read_prompts(data)
    model = load(cfg.model, variant=cfg.variant, threads=cfg.threads)
    tok = model.tokenizer
    if tok is None:
        raise BenchError(f"{cfg.model} has no tokenizer: the benchmark sends chat messages")
    fits = lambda p: prompt_fits(model, p, cfg.max_new_tokens)  # noqa: E731
    prompts = select(corpus, cfg.categories, cfg.per_category, fits, cfg.skip)
    if cfg.ngram and cfg.genai_ngram == NGRAM_SWEEP:  # fail before anything slow if nothing is left to sweep on
        from .ngram import sweep_prompts

        sweep_prompts(corpus, cfg, prompts, fits)
    if not prompts:
        raise BenchError("no prompt fits the model: lower --max-new-tokens")
    store = RecordStore(out, cfg, resume)
    todo = [p for p in prompts if not store.done(p, cfg.timed)]
    facts = run_facts()  # where and when the timings are taken, named in results.json
    logger.info(
        "bench %s (%s): %d prompts × %d methods%s into %s%s, on %s, %d threads",
        cfg.model,
        model.variant,
        len(prompts),
        len(cfg.methods),
        f" + {', '.join(cfg.peer_methods)}" if cfg.compare else "",
        out,
        f" ({len(prompts) - len(todo)} already done)" if resume else "",
        describe(facts),
        cfg.threads,
    )
    if not cfg.greedy:
        logger.info(
            "temperature %.2f: outputs may differ from baseline; match %% is reported, not gated", cfg.temperature
        )
    peers: list = []
    if todo:
        pool = DrafterPool(cfg, lambda t: tok.encode(t, add_special_tokens=False), corpus)
        warm = as_prompt(model, [{"role": "user", "content": todo[0].turns[0]}])
        warm_n = min(WARMUP_TOKENS, cfg.max_new_tokens)
        model.generate(warm, DecodeSettings(max_new_tokens=warm_n))  # warm-up: ORT's first-run costs
        ctx = PeerContext(model, cfg, out, corpus, prompts, fits, resume, model.encode(warm), warm_n)
        peers = load_peers(ctx)
        for peer in list(peers):
            try:
                peer.generate(ctx.warmup_ids, warm_n)
            except BenchError as e:  # it cannot run even the warm-up: one line, the run goes on without it
                logger.warning("%s skipped: %s", peer.name, str(e)[:400])
                peers.remove(peer)
        row_costs = _row_costs(model, out, warm)
        for p in progress(todo, "bench", total=len(todo)):
            store.append(run_prompt(model, p, pool, cfg, peers))
    else:
        row_costs = _row_costs(model, out, None)
    records = store.for_prompts(prompts, cfg.timed)
    failures = gate_failures(records) if cfg.greedy else []
    report = aggregate(records, cfg.timed, cfg.categories, row_costs)
    meta: dict[str, Any] = {
        "config": cfg.to_json(),
        "machine": facts,
        "model_folder": str(model.folder),
        "model_variant": model.variant,
        "data": str(data),
        "prompt_format": prompt_format(model),
        "prompts": {c: [p.qid for p in prompts if p.category == c] for c in cfg.categories},
        "gate": {
            "mode": "greedy" if cfg.greedy else "sampling (not gated)",
            "passed": not failures,
            "generations": len(records),
            "mismatches": [
                {k: r[k] for k in ("method", "qid", "category", "turn", "first_mismatch")} for r in failures
            ],
        },
    }
    if cfg.compare:
        meta["peers"] = {
            p.name: {**p.describe(), "quality": p.quality(model.folder)} for p in peers
        } or _recorded_peers(out)
        for m in cfg.peer_methods:
            if m in PLAIN_OF and m in meta["peers"]:
                meta["peers"][m]["vs_plain"] = _vs_plain(records, m)
        meta["gate"]["not_gated"] = [*cfg.peer_methods, *([RAW_BASELINE] if RAW_BASELINE in cfg.methods else [])]
    if row_costs:
        meta["row_costs_ms"] = {str(r): round(1e3 * t, 3) for r, t in row_costs.items()}
    slower = report.slower()
    meta["never_slower"] = {
        "methods": [m for m in NEVER_SLOWER if m in cfg.methods],
        "passed": not slower,
        "slower": [
            {"method": r.method, "category": r.category, "speedup": r.speedup, "noise": r.noise} for r in slower
        ],
    }
    for r in slower:
        logger.error(
            "✗ %s is slower than baseline on %s: %.2fx (noise ±%.0f%%)",
            r.method,
            r.category,
            r.speedup,
            100 * (r.noise or 0.0),
        )
    write_outputs(report, out, meta)
    if failures:
        raise ExactnessError(_gate_message(failures, len(records), out), failures, report)
    return report
