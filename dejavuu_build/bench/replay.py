"""Offline replay: every drafter against recorded greedy answers, step by step, without the model.

Why: on a shared machine wall-clock timings move by ±10% between runs, while acceptance does not.
A greedy answer is what every lossless method must reproduce, so a method's steps on a prompt are
fully decided by its drafts and that answer. ``record`` decodes each prompt plainly once (the
bench's prompts and chat turns) and keeps, per turn, the prompt ids, the answer ids and the
verifier's top-k ids at every answer position; ``replay`` then drives each method through the same
calls the engine makes (``runtime.job.Job``: ``begin``, the prefill token's ``feedback``, then per
step ``propose`` on the committed context with the step's budget, the engine's successor fill on
empty steps, and ``feedback`` with what was accepted, the verifier's top-k rows and the step's
rows and verify time), accepting the longest draft prefix equal to the answer plus the bonus
token. A step of R graph rows costs ``row_costs[R]`` one-row steps; the method's own ``propose``
time, measured here, is added at ``step_ms`` per one-row step. The copy oracle (``bench.oracle``)
gives the bound; the report is tokens per step, the estimated speedup over plain decoding and the
share of the oracle's gain, per category (``overall``: geometric means, as the bench).

What it cannot know: the verifier's output after a rejected draft token (its top-k row and its
argmax) -- those rows are left out of the feedback, so token recycling and the successor fill learn
a little less than in a real run; and host time other than drafting (about the same per step for
every method).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import numpy as np

from ..log import logger, progress
from ..machine import run_facts
from ..runtime.drafters import Draft, DraftBudget, Drafter, Feedback
from .config import BenchConfig, BenchError, Prompt, as_prompt, read_prompts, resolve_data, select
from .oracle import MAX_DRAFT, measure_row_costs, plan, relative_costs, runs
from .report import OVERALL, geomean

if TYPE_CHECKING:
    from ..runtime.model import Model

FORMAT = 1
TOPK = 8  # the engine's top-k per verified row (runtime.job._topk_rows)
# one run's probe on this machine (docs/methods.md, 2026-12-05): a step of R rows × a one-row step
DEFAULT_ROW_COSTS = {1: 1.0, 2: 1.23, 3: 1.39, 4: 1.51, 5: 1.53, 6: 1.73, 7: 2.25, 8: 2.17}
DEFAULT_STEP_MS = 10.0
BUDGET = DraftBudget()  # the engine's chain budget: 8 nodes, 8 deep


@dataclass
class Turn:
    """One recorded turn: the ids sent, plain decoding's answer, the top-k ids at each answer position."""

    qid: str
    category: str
    turn: int
    prompt: list[int]
    answer: list[int]
    topk: list[list[int]]  # topk[i]: the verifier's top-k where answer[i] was produced (topk[i][0] == answer[i])
    stop_reason: str | None = None


@dataclass
class Recording:
    model: str
    variant: str | None
    max_new_tokens: int
    row_costs_s: dict[int, float]  # seconds of a step of R graph rows, measured while recording
    turns: list[Turn]
    meta: dict = field(default_factory=dict)

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        d = asdict(self)
        d["format"] = FORMAT
        d["row_costs_s"] = {str(k): v for k, v in self.row_costs_s.items()}
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(d) + "\n")
        os.replace(tmp, path)  # atomic: a crash never leaves half a recording
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Recording":
        try:
            d = json.loads(Path(path).expanduser().read_text())
        except (OSError, ValueError) as e:
            raise BenchError(f"{path} is not a replay recording ({e})") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise BenchError(f"{path}: not a replay recording of format {FORMAT}; record it again (another path)")
        return cls(
            model=d["model"],
            variant=d.get("variant"),
            max_new_tokens=int(d["max_new_tokens"]),
            row_costs_s={int(k): float(v) for k, v in d.get("row_costs_s", {}).items()},
            turns=[Turn(**t) for t in d["turns"]],
            meta=d.get("meta", {}),
        )

    def relative_costs(self) -> dict[int, float]:
        return relative_costs(self.row_costs_s) if 1 in self.row_costs_s else dict(DEFAULT_ROW_COSTS)


# ---------------------------------------------------------------------------------- recording
class _TopkRecorder(Drafter):
    """Plain decoding (never drafts) that keeps the verifier's top-k row of every committed token."""

    name = "topk_recorder"
    wants_topk = True

    def __init__(self) -> None:
        self.rows: list[list[int]] = []

    def begin(self, prompt_ids):
        self.rows = []

    def feedback(self, fb: Feedback) -> None:
        if fb.topk_ids is not None:
            self.rows.extend(np.asarray(fb.topk_ids)[:1].tolist())


def record(cfg: BenchConfig, path: str | os.PathLike) -> Recording:
    """Decode the bench's prompts (``cfg``'s categories and count) plainly, each turn on the previous
    turns' answers as the bench sends them, and save the recording to ``path``."""
    from ..runtime import load
    from ..runtime.settings import DecodeSettings
    from .runner import prompt_fits

    if not cfg.greedy:
        raise BenchError("the replay needs greedy answers: drop --temperature")
    data = resolve_data(cfg.data)
    model = load(cfg.model, variant=cfg.variant, threads=cfg.threads)
    if model.tokenizer is None:
        raise BenchError(f"{cfg.model} has no tokenizer: the benchmark sends chat messages")
    prompts = select(
        read_prompts(data),
        cfg.categories,
        cfg.per_category,
        lambda p: prompt_fits(model, p, cfg.max_new_tokens),
        cfg.skip,
    )
    if not prompts:
        raise BenchError("no prompt fits the model: lower --max-new-tokens")
    warm = as_prompt(model, [{"role": "user", "content": prompts[0].turns[0]}])
    model.generate(warm, DecodeSettings(max_new_tokens=8))
    costs = measure_row_costs(model, warm, rows=MAX_DRAFT + 1)
    rec = Recording(
        cfg.model,
        model.variant,
        cfg.max_new_tokens,
        costs,
        [],
        {**run_facts(), "data": str(data), "model_folder": str(model.folder), "skip": cfg.skip},
    )
    fill, model.fill = model.fill, False  # one token per step: a top-k row for every answer position
    try:
        for p in progress(prompts, "record", total=len(prompts)):
            rec.turns += _record_prompt(model, p, cfg)
    finally:
        model.fill = fill
    rec.save(path)
    logger.info("recorded %d turns of %d prompts into %s", len(rec.turns), len(prompts), path)
    return rec


def _record_prompt(model: Model, p: Prompt, cfg: BenchConfig) -> list[Turn]:
    from ..runtime.settings import DecodeSettings

    out: list[Turn] = []
    messages: list[dict] = []
    for turn, text in enumerate(p.turns, 1):
        messages.append({"role": "user", "content": text})
        sent = as_prompt(model, messages)
        rec = _TopkRecorder()
        res = model.generate(sent, DecodeSettings(method=rec, max_new_tokens=cfg.max_new_tokens, width=cfg.width))
        answer = [int(t) for t in res.tokens]
        if len(rec.rows) != len(answer) or any(r[0] != t for r, t in zip(rec.rows, answer)):
            raise BenchError(f"prompt {p.qid} turn {turn}: the top-k rows do not match the answer")
        out.append(Turn(p.qid, p.category, turn, model.encode(sent), answer, rec.rows, res.stop_reason))
        messages.append({"role": "assistant", "content": res.text})
    return out


# ---------------------------------------------------------------------------------- replay
@dataclass
class TurnResult:
    tokens: int = 0  # answer tokens (the first comes out of prefill)
    steps: int = 0
    drafted: int = 0
    accepted: int = 0  # accepted draft tokens (the engine's fill guesses included)
    cost: float = 0.0  # verify cost in one-row steps
    draft_s: float = 0.0


def replay_turn(
    drafter: Drafter,
    t: Turn,
    cost: Mapping[int, float],
    *,
    budget: DraftBudget = BUDGET,
    step_s: float = DEFAULT_STEP_MS / 1e3,
    fill: bool = True,
) -> TurnResult:
    """``drafter`` on one recorded turn, called as ``runtime.job.Job`` calls it (chains; a rowwise
    decoder: a lone token is one row). ``fill``: the engine's successor guess on empty steps where
    it pays (``Job``'s ``Successors`` and ``FillPolicy``)."""
    from ..runtime.job import FillPolicy, Successors, cut_step

    top = max(cost)
    answer, topk = t.answer, t.topk
    eos = {answer[-1]} if t.stop_reason == "eos" and answer else set()
    max_new = len(answer) if t.stop_reason != "eos" else len(answer) + 1
    r = TurnResult(tokens=len(answer))
    if not answer:
        return r
    tokens = [int(x) for x in t.prompt]
    succ = Successors() if fill else None
    policy = FillPolicy() if fill else None
    filled = fill_ok = 0
    if succ is not None:
        succ.seed(tokens)
    drafter.begin(tokens)
    tokens.append(answer[0])
    new = [answer[0]]
    drafter.feedback(
        Feedback(
            committed=[answer[0]], drafted=0, accepted=0, topk_ids=np.asarray(topk[:1]) if drafter.wants_topk else None
        )
    )
    _, reason = cut_step([], [answer[0]], eos, max_new, None)
    while reason is None:
        remaining = max_new - len(new)
        b = DraftBudget(
            min(budget.max_nodes, 8 * remaining), min(budget.max_depth, remaining - 1), budget.width, budget.tree
        )
        t0 = time.perf_counter()
        draft = drafter.propose(tokens, b) if b.max_depth > 0 else Draft()
        dt = time.perf_counter() - t0
        draft.validate()
        draft = draft.within(b)
        draft.validate(b)
        own = len(draft)
        guess = succ.guess(tokens) if not own and succ is not None and b.max_depth > 0 else None
        if guess is not None and policy is not None and policy.pays(filled, fill_ok):
            draft = Draft([guess], [-1])
            filled += 1
        pos = len(new)
        truth = answer[pos:]
        path = _accepted_path(draft, truth)
        acc = len(path)
        committed = truth[: acc + 1]
        rows = len(draft) + 1
        step_cost = cost[min(rows, top)]
        if policy is not None:
            policy.observe(rows, step_cost * step_s)
        if succ is not None:  # the rows whose output is known: the root and the accepted nodes
            rows_in = ([tokens[-1]] + [draft.tokens[i] for i in path])[: len(committed)]
            before: list[int | None] = [tokens[-2] if len(tokens) > 1 else None, *rows_in[:-1]]
            succ.learn(rows_in, np.asarray(committed), before)
            fill_ok += int(own == 0 and acc > 0)
        r.steps += 1
        r.drafted += len(draft)
        r.accepted += acc
        r.cost += step_cost
        r.draft_s += dt
        committed, reason = cut_step(new, committed, eos, max_new, None)
        tokens += committed
        new += committed
        paid_fill = policy is not None and not own and len(draft) > 0
        # top-k rows whose values are known: the root's and, for a chain, the accepted nodes'
        known = acc + 1 if own and draft.is_chain() else 1
        drafter.feedback(
            Feedback(
                committed=committed,
                drafted=own,
                accepted=acc if own else 0,
                accepted_path=path if own else [],
                topk_ids=np.asarray(topk[pos : pos + known]) if drafter.wants_topk else None,
                draft_seconds=dt,
                verify_seconds=0.0 if paid_fill else step_cost * step_s,
                rows=1 if paid_fill else rows,
            )
        )
    drafter.end()
    if new != answer:
        raise BenchError(f"replay of prompt {t.qid} turn {t.turn} did not reproduce the answer")
    return r


def _accepted_path(draft: Draft, truth: Sequence[int]) -> list[int]:
    """Draft node indices a greedy verifier producing ``truth`` accepts, root to leaf."""
    kids = {(p, tok): i for i, (tok, p) in enumerate(zip(draft.tokens, draft.parents))}
    node, path = -1, []
    for tok in truth:
        nxt = kids.get((node, int(tok)))
        if nxt is None:
            break
        path.append(nxt)
        node = nxt
    return path


@dataclass
class ReplayRow:
    category: str
    method: str
    tokens_per_step: float
    speedup: float  # over plain decoding, at the row costs, the method's draft time included
    speedup_no_draft: float  # ... at the row costs only
    oracle_tokens_per_step: float
    oracle_speedup: float
    share: float | None  # (speedup - 1) / (oracle speedup - 1)
    acceptance: float  # accepted / drafted
    draft_ms_per_step: float


def oracle_cost(t: Turn, cost: Mapping[int, float]) -> tuple[int, float]:
    """(steps, cost in one-row steps) of the copy oracle on this turn (``bench.oracle``)."""
    return plan(runs(t.prompt, t.answer), cost)


def default_factory(rec: Recording, data: str | None = None) -> Callable[[str, str], Drafter]:
    """One drafter per method for the whole replay, as the bench's ``DrafterPool`` (retrieval methods
    with a datastore: one per category, of the other categories' prompts, encoded by the recorded
    model's tokenizer, loaded only if such a method is asked for)."""
    from .runner import DrafterPool

    state: dict = {}

    def encode(text: str) -> list[int]:
        if "tok" not in state:
            from ..runtime.tokenizer import TextTokenizer

            state["tok"] = TextTokenizer(Path(rec.meta.get("model_folder", rec.model)))
        return state["tok"].encode(text, add_special_tokens=False)

    def corpus() -> list[Prompt]:
        return read_prompts(resolve_data(data or rec.meta.get("data")))

    def make(method: str, category: str) -> Drafter:
        if "pool" not in state:
            cfg = BenchConfig(model=rec.model, methods=(method,))

            class LazyCorpus(list):
                def __iter__(self):
                    if not len(self):
                        self.extend(corpus())
                    return super().__iter__()

            state["pool"] = DrafterPool(cfg, encode, LazyCorpus())
        return state["pool"].get(method, category)

    return make


def replay(
    rec: Recording,
    methods: Sequence[str],
    *,
    cost: Mapping[int, float] | None = None,
    step_ms: float | None = None,
    budget: DraftBudget = BUDGET,
    fill: bool = True,
    categories: Sequence[str] | None = None,
    per_category: int | None = None,
    make: Callable[[str, str], Drafter] | None = None,
) -> list[ReplayRow]:
    """Rows per category (recording order) × method, then ``overall`` (geometric means over the
    categories, as the bench's report). ``cost``: relative cost of a step of R rows (default: the
    recording's probe); ``step_ms``: a one-row step (default: the recording's, else 10 ms);
    ``per_category``: the first that many recorded prompts of each category (the bench's order)."""
    cost = dict(cost or rec.relative_costs())
    if step_ms is None:
        step_ms = 1e3 * rec.row_costs_s[1] if 1 in rec.row_costs_s else DEFAULT_STEP_MS
    step_s = step_ms / 1e3
    turns = [t for t in rec.turns if categories is None or t.category in categories]
    if per_category is not None:
        first: dict[str, list[str]] = {}
        for t in turns:
            qids = first.setdefault(t.category, [])
            if t.qid not in qids and len(qids) < per_category:
                qids.append(t.qid)
        turns = [t for t in turns if t.qid in first[t.category]]
    cats = list(dict.fromkeys(t.category for t in turns))
    make = make or default_factory(rec)
    oracle: dict[str, tuple[float, float]] = {}
    for c in cats:
        ct = [t for t in turns if t.category == c]
        n = sum(max(len(t.answer) - 1, 0) for t in ct)
        steps, spent = map(sum, zip(*(oracle_cost(t, cost) for t in ct)))
        oracle[c] = (n / steps if steps else 1.0, n / spent if spent else 1.0)
    rows: list[ReplayRow] = []
    for m in methods:
        got: dict[str, list[TurnResult]] = {c: [] for c in cats}
        for t in progress(turns, f"replay {m}", total=len(turns)):
            got[t.category].append(
                replay_turn(make(m, t.category), t, cost, budget=budget, step_s=step_s, fill=fill and m != "baseline")
            )
        for c in cats:
            rows.append(_row(c, m, got[c], oracle[c], step_s))
    out = list(rows)
    for m in methods:
        mine = [r for r in rows if r.method == m]
        if not mine:
            continue
        sp = geomean([r.speedup for r in mine]) or 1.0
        o = geomean([r.oracle_speedup for r in mine]) or 1.0
        out.append(
            ReplayRow(
                OVERALL,
                m,
                geomean([r.tokens_per_step for r in mine]) or 1.0,
                sp,
                geomean([r.speedup_no_draft for r in mine]) or 1.0,
                geomean([r.oracle_tokens_per_step for r in mine]) or 1.0,
                o,
                (sp - 1) / (o - 1) if o > 1 else None,
                statistics.fmean(r.acceptance for r in mine),
                statistics.fmean(r.draft_ms_per_step for r in mine),
            )
        )
    return out


def _row(c: str, m: str, res: Sequence[TurnResult], oracle: tuple[float, float], step_s: float) -> ReplayRow:
    n = sum(max(r.tokens - 1, 0) for r in res)
    steps = sum(r.steps for r in res)
    verify = sum(r.cost for r in res)
    draft = sum(r.draft_s for r in res)
    sp = n / (verify + draft / step_s) if verify else 1.0
    return ReplayRow(
        c,
        m,
        n / steps if steps else 1.0,
        sp,
        n / verify if verify else 1.0,
        oracle[0],
        oracle[1],
        (sp - 1) / (oracle[1] - 1) if oracle[1] > 1 else None,
        sum(r.accepted for r in res) / max(sum(r.drafted for r in res), 1),
        1e3 * draft / steps if steps else 0.0,
    )


def table(rows: Sequence[ReplayRow]) -> str:
    """One line per row: tokens per step, speedup (with and without draft time), share of the oracle's gain."""
    head = f"{'category':<15} {'method':<18} {'tok/step':>8} {'x plain':>8} {'x nodraft':>9} {'oracle':>13} {'share':>6} {'accept':>6} {'draft ms':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        sh = "-" if r.share is None else f"{100 * r.share:.0f}%"
        lines.append(
            f"{r.category:<15} {r.method:<18} {r.tokens_per_step:8.2f} {r.speedup:8.2f} {r.speedup_no_draft:9.2f} "
            f"{r.oracle_tokens_per_step:5.2f}t {r.oracle_speedup:5.2f}x {sh:>6} {r.acceptance:6.2f} {r.draft_ms_per_step:8.2f}"
        )
    return "\n".join(lines)


def write(rows: Sequence[ReplayRow], path: str | os.PathLike, meta: dict | None = None) -> Path:
    """``path`` as CSV (one line per row) and, beside it, ``.json`` with ``meta``."""
    import csv

    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    names = list(asdict(rows[0])) if rows else []
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=names)
        w.writeheader()
        for r in rows:
            w.writerow({k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(r).items()})
    path.with_suffix(".json").write_text(
        json.dumps({**(meta or {}), "rows": [asdict(r) for r in rows]}, indent=2) + "\n"
    )
    return path
