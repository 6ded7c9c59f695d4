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
from collections import defaultdict
from dataclasses import asdict, dataclass
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

from .. import schema as S
from ..errors import DejavuuError
from ..log import logger, progress
from ..rows import json_row, not_utf8
from .oracle import MAX_DRAFT, measure_row_costs, runs
from .peer import KINDS, PEER_METHODS, PLAIN_OF
from .report import NEVER_SLOWER, Report, aggregate, write_outputs

if TYPE_CHECKING:
    from ..runtime.model import GenerationResult, Model
    from ..runtime.tokenizer import TextTokenizer

TASK_CATEGORIES: tuple[str, ...] = ("translation", "summarization", "qa", "math_reasoning", "rag")
DEFAULT_CATEGORIES: tuple[str, ...] = (*TASK_CATEGORIES, "mt_bench")
# Spec-Bench files its 80 MT-Bench prompts under MT-Bench's own 8 categories.
MT_BENCH_SOURCES = frozenset({"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"})
SPEC_BENCH_HINT = (
    "pass --data PATH to Spec-Bench's question.jsonl (https://github.com/hemingkx/Spec-Bench, "
    "file data/spec_bench/question.jsonl)"
)
# Plain decoding on ORT's one-row kernel path: the fastest plain decoding, but its logits differ in
# the last bits from multi-row forwards (see Decoder.forward), so it is timed, not gated.
RAW_BASELINE = "baseline_n1"
# "<method>+tree" runs that method with tree verification in the same run (chain vs tree on the
# same prompts, interleaved), whatever --tree says for the plain names.
TREE_SUFFIX = "+tree"


def base_method(method: str) -> str:
    return method[: -len(TREE_SUFFIX)] if method.endswith(TREE_SUFFIX) else method


PEERS: tuple[str, ...] = tuple(KINDS)  # --compare: other systems, timed on the same prompt ids (bench.peer)
GENAI = "genai"  # the peer whose n-gram options BenchConfig.genai_ngram carries
NGRAM_SWEEP, NGRAM_OFF = "sweep", "off"  # BenchConfig.genai_ngram, besides a fixed "N,K"
RECORDS_FILE = "records.jsonl"
ROW_COSTS_FILE = "row_costs.json"  # seconds of a decode step of R graph rows, measured by the run (bench.oracle)
CONFIG_FILE = "config.json"
WARMUP_TOKENS = 8


class BenchError(DejavuuError):
    """The benchmark cannot run as asked (no data, unknown category or method, resume mismatch)."""


class ExactnessError(BenchError):
    """A method's greedy output differs from plain decoding: the lossless guarantee is broken."""

    def __init__(self, message: str, failures: list[dict], report: Report | None = None):
        super().__init__(message)
        self.failures = failures
        self.report = report


@dataclass(frozen=True)
class Prompt:
    qid: str
    category: str  # the bench category (mt_bench for all 8 MT-Bench categories)
    source: str  # the category as written in the data file
    turns: tuple[str, ...]


@dataclass
class BenchConfig:
    model: str
    methods: tuple[str, ...] = ("baseline", "pld")
    categories: tuple[str, ...] = DEFAULT_CATEGORIES
    per_category: int = 10
    max_new_tokens: int = S.DEFAULT_MAX_NEW_TOKENS
    threads: int = S.DEFAULT_THREADS
    tree: bool = False
    width: int = S.DEFAULT_TREE_WIDTH
    variant: str | None = None
    temperature: float = 0.0
    seed: int = 0
    datastore: str | None = None
    data: str | None = None
    compare: tuple[str, ...] = ()  # peer kinds timed beside our methods (bench.peer.KINDS)
    contexts: tuple[int, ...] = ()  # a context sweep instead of Spec-Bench categories (bench.sweep)
    repeats: int = 1  # sweep: runs per context (medians are reported)
    verify_rows: tuple[int, ...] = ()  # sweep: also time verify steps of these graph row counts (bench.sweep)
    # with --compare genai, genai's n-gram speculative decoding too: "sweep" (pick its options on
    # prompts outside the measured set, bench.ngram), a fixed "N,K", or "off"
    genai_ngram: str = NGRAM_SWEEP

    # What a resumed run must share with the run it continues: anything that changes the
    # generated tokens or the timings. Categories, prompt counts and the data path may grow.
    RESUME_KEYS = (
        "model",
        "variant",
        "methods",
        "max_new_tokens",
        "threads",
        "tree",
        "width",
        "temperature",
        "seed",
        "datastore",
        "compare",
        "genai_ngram",
    )

    def __post_init__(self) -> None:
        from ..runtime.drafters import METHODS

        methods = ["baseline"] + [m for m in self.methods if m != "baseline"]
        self.methods = tuple(dict.fromkeys(methods))
        if theirs := [m for m in self.methods if m in PEER_METHODS]:
            raise BenchError(f"{', '.join(theirs)} is not one of our methods: time it with --compare")
        self.compare = tuple(dict.fromkeys(self.compare))
        if bad := [c for c in self.compare if c not in PEERS]:
            raise BenchError(f"unknown --compare {', '.join(bad)}; choose from: {', '.join(PEERS)}")
        if self.compare and self.temperature > 0.0:
            raise BenchError("--compare times greedy decoding only: drop --temperature")
        self.genai_ngram = str(self.genai_ngram or NGRAM_OFF).replace(" ", "")
        if self.genai_ngram not in (NGRAM_SWEEP, NGRAM_OFF):
            from .genai import parse_ngram

            n, k = parse_ngram(self.genai_ngram)
            self.genai_ngram = f"{n},{k}"
            if GENAI not in self.compare:
                raise BenchError("--genai-ngram times genai's n-gram speculative decoding: add --compare genai")
            if self.contexts:
                raise BenchError("--genai-ngram is part of the Spec-Bench run; a context sweep times plain decoding")
        if GENAI not in self.compare or self.contexts:
            self.genai_ngram = NGRAM_OFF  # nothing to run it beside; recorded as such
        self.contexts = tuple(int(c) for c in self.contexts)
        if self.contexts and (other := [c for c in self.compare if c != GENAI]):
            raise BenchError(f"the context sweep compares with genai only (not {', '.join(other)}): drop --contexts")
        if any(c < 1 for c in self.contexts) or self.repeats < 1:
            raise BenchError("--contexts and --repeats take positive numbers")
        self.verify_rows = tuple(dict.fromkeys(int(r) for r in self.verify_rows))
        if any(r < 2 for r in self.verify_rows):
            raise BenchError("--verify-rows takes row counts of 2 or more (1 row is plain decoding, always timed)")
        if self.verify_rows and not self.contexts:
            raise BenchError("--verify-rows is part of the context sweep: add --contexts 256,1024,...")
        bad = [m for m in self.methods if base_method(m) not in METHODS and m != RAW_BASELINE]
        if bad:
            raise BenchError(f"unknown method(s) {', '.join(bad)}; choose from: {', '.join(METHODS)}, {RAW_BASELINE}")
        self.categories = tuple(dict.fromkeys(self.categories))
        if not self.categories:
            raise BenchError("no categories to run")
        if self.per_category < 1 or self.max_new_tokens < 1:
            raise BenchError("--per-category and --max-new-tokens must be at least 1")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def ngram(self) -> bool:
        """Whether genai's n-gram speculative decoding is timed beside its plain decoding."""
        return self.genai_ngram != NGRAM_OFF

    @property
    def peer_methods(self) -> tuple[str, ...]:
        """The peers' records, each kind's plain decoding before its speculative one (genai's n-gram
        decoding only with ``genai_ngram``)."""
        out: list[str] = []
        for k in self.compare:
            out += KINDS[k].methods[: 1 if k == GENAI and not self.ngram else None]
        return tuple(out)

    @property
    def timed(self) -> tuple[str, ...]:
        """Everything run per prompt: our methods (baseline first), then the peers."""
        return (*self.methods, *self.peer_methods)

    def to_json(self) -> dict:
        d = asdict(self)
        for k in ("methods", "categories", "compare", "contexts", "verify_rows"):
            d[k] = list(getattr(self, k))
        return d


# ---------------------------------------------------------------------------------- prompts
def bench_category(raw: str) -> str:
    return "mt_bench" if raw in MT_BENCH_SOURCES else raw


def default_data_path() -> Path | None:
    """Spec-Bench next to the project checkout, else next to the current directory."""
    import dejavuu_build

    rel = Path("shared", "data", "spec_bench", "question.jsonl")
    for base in (Path(dejavuu_build.__file__).resolve().parents[1].parent, Path.cwd().parent):
        if (base / rel).is_file():
            return base / rel
    return None


def resolve_data(path: str | os.PathLike | None) -> Path:
    if path is None:
        found = default_data_path()
        if found is None:
            raise BenchError(f"no Spec-Bench data found: {SPEC_BENCH_HINT}")
        return found
    p = Path(path).expanduser()
    if not p.is_file():
        raise BenchError(f"{p} is not a file: {SPEC_BENCH_HINT}")
    return p


def read_prompts(path: Path) -> list[Prompt]:
    """Rows ``{"question_id", "category", "turns": [...]}``, in file order."""
    out: list[Prompt] = []
    try:
        with path.open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:  # not JSON, nested too deeply, a lone surrogate, or not such a row
                    row = json_row(line, f"{path}:{n}")
                    turns = tuple(str(t) for t in row["turns"])
                    qid, raw = str(row["question_id"]), str(row["category"])
                except (ValueError, KeyError, TypeError) as e:
                    raise BenchError(
                        f"{path}:{n}: not a Spec-Bench row {{question_id, category, turns}} ({e})"
                    ) from None
                if turns:
                    out.append(Prompt(qid, bench_category(raw), raw, turns))
    except UnicodeDecodeError as e:
        raise BenchError(not_utf8(path, e)) from None
    return out


def select(
    prompts: Sequence[Prompt], categories: Sequence[str], n: int, fits: Callable[[Prompt], bool] = lambda p: True
) -> list[Prompt]:
    """The first ``n`` prompts of each category that fit the model, deterministically.

    Within a category the source categories take turns (MT-Bench: writing, roleplay, ...), so a
    small ``n`` still samples all of mt_bench rather than its first 10 writing prompts.
    """
    by_cat = _by_category(prompts)
    missing = [c for c in categories if c not in by_cat]
    if missing:
        raise BenchError(
            f"no prompts for categor{'y' if len(missing) == 1 else 'ies'} {', '.join(missing)} in the "
            f"data; it has: {', '.join(by_cat)}"
        )
    chosen: list[Prompt] = []
    for cat in categories:
        picked = list(islice(filter(fits, _interleaved(by_cat[cat])), n))
        if len(picked) < n:
            logger.warning(
                "%s: only %d of the %d prompts asked for (of %d in the data) fit the model",
                cat,
                len(picked),
                n,
                len(_interleaved(by_cat[cat])),
            )
        chosen += picked
    return chosen


def _by_category(prompts: Sequence[Prompt]) -> dict[str, dict[str, list[Prompt]]]:
    by_cat: dict[str, dict[str, list[Prompt]]] = defaultdict(lambda: defaultdict(list))
    for p in prompts:
        by_cat[p.category][p.source].append(p)
    return by_cat


def _interleaved(sources: dict[str, list[Prompt]]) -> list[Prompt]:
    """A category's prompts, its source categories taking turns (the order ``select`` picks in)."""
    queues = list(sources.values())
    return [q[i] for i in range(max(map(len, queues))) for q in queues if i < len(q)]


def select_next(
    prompts: Sequence[Prompt],
    categories: Sequence[str],
    taken: Sequence[Prompt],
    n: int,
    fits: Callable[[Prompt], bool] = lambda p: True,
) -> list[Prompt]:
    """The next ``n`` fitting prompts of each category after ``taken`` (what ``select`` chose), in
    the same order: prompts outside the measured set, e.g. to tune a peer's options on."""
    by_cat, seen = _by_category(prompts), {p.qid for p in taken}
    out: list[Prompt] = []
    for cat in categories:
        out += list(islice((p for p in _interleaved(by_cat.get(cat) or {"": []}) if p.qid not in seen and fits(p)), n))
    return out


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


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def make_record(
    p: Prompt, turn: int, method: str, res: GenerationResult, baseline_ids: Sequence[int], gated: bool = True
) -> dict:
    """Everything the report needs about one generation, plus its agreement with baseline."""
    s = res.stats
    common = _common_prefix(res.tokens, baseline_ids)
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


def _fits(model: Model, p: Prompt, max_new_tokens: int) -> bool:
    """Whether the whole conversation (answers at their longest) fits the model's positions."""
    limit = model.contract.max_positions
    if not limit:
        return True
    msgs: list[dict] = []
    for t in p.turns:
        msgs += [{"role": "user", "content": t}, {"role": "assistant", "content": ""}]
    return len(_tokenizer(model).encode_chat(msgs[:-1])) + len(p.turns) * max_new_tokens <= limit


def peer_record(
    p: Prompt, turn: int, res, baseline_ids: Sequence[int], method: str, plain_ids: Sequence[int] | None = None
) -> dict:
    """A peer's generation (``peer.PeerResult``) as a record: timed, compared with baseline, never gated.

    Plain decoding's steps are one forward + sampling each; a speculative peer's steps are its
    target forwards and its drafted / accepted are its own counts. The whole decode time counts as
    verify time (peers expose no split). ``plain_ids`` (the peer's own plain decoding of this turn)
    adds a speculative peer's match with it: what its drafting keeps of it.
    """
    common = _common_prefix(res.tokens, baseline_ids)
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
            plain_common_prefix=_common_prefix(res.tokens, plain_ids),
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
        res = peer.generate(model.encode(list(messages)), cfg.max_new_tokens)
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
        raw = method == RAW_BASELINE
        tree = cfg.tree or method.endswith(TREE_SUFFIX)
        messages: list[dict] = []
        for turn, text in enumerate(p.turns, 1):
            messages.append({"role": "user", "content": text})
            # every method runs as `generate` runs it for a user; only the raw reference
            # (baseline_n1) drops the pad row of a padded decoder
            with model.decoder.padding(False if raw else model.decoder.pad_single):
                res = model.generate(
                    list(messages),
                    method=drafter,
                    tree=tree,
                    width=cfg.width,
                    max_new_tokens=cfg.max_new_tokens,
                    temperature=cfg.temperature,
                    seed=cfg.seed,
                )
            if method == "baseline":
                baseline.append(list(res.tokens))
            rec = make_record(p, turn, method, res, baseline[turn - 1], gated=not raw)
            if method == "baseline":  # what the copy oracle could draft at each step (bench.oracle)
                rec["oracle_runs"] = runs(model.encode(list(messages)), res.tokens)
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
        got = run_peer(model, peer, p, cfg, baseline, own.get(PLAIN_OF.get(peer.name, "")))
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


def _row_costs(model: Model, out: Path, messages: list[dict] | None) -> dict[int, float]:
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
    fits = lambda p: _fits(model, p, cfg.max_new_tokens)  # noqa: E731
    prompts = select(corpus, cfg.categories, cfg.per_category, fits)
    if cfg.ngram and cfg.genai_ngram == NGRAM_SWEEP:  # fail before anything slow if nothing is left to sweep on
        from .ngram import sweep_prompts

        sweep_prompts(corpus, cfg, prompts, fits)
    if not prompts:
        raise BenchError("no prompt fits the model: lower --max-new-tokens")
    store = RecordStore(out, cfg, resume)
    todo = [p for p in prompts if not store.done(p, cfg.timed)]
    logger.info(
        "bench %s (%s): %d prompts × %d methods%s into %s%s",
        cfg.model,
        model.variant,
        len(prompts),
        len(cfg.methods),
        f" + {', '.join(cfg.peer_methods)}" if cfg.compare else "",
        out,
        f" ({len(prompts) - len(todo)} already done)" if resume else "",
    )
    if not cfg.greedy:
        logger.info(
            "temperature %.2f: outputs may differ from baseline; match %% is reported, not gated", cfg.temperature
        )
    peers: list = []
    if todo:
        pool = DrafterPool(cfg, lambda t: tok.encode(t, add_special_tokens=False), corpus)
        warm = [{"role": "user", "content": todo[0].turns[0]}]
        warm_n = min(WARMUP_TOKENS, cfg.max_new_tokens)
        model.generate(warm, method="baseline", max_new_tokens=warm_n)  # warm-up: ORT's first-run costs
        ctx = PeerContext(model, cfg, out, corpus, prompts, fits, resume, model.encode(warm), warm_n)
        peers = load_peers(ctx)
        for peer in peers:
            peer.generate(ctx.warmup_ids, warm_n)
        row_costs = _row_costs(model, out, [{"role": "user", "content": todo[0].turns[0]}])
        for p in progress(todo, "bench", total=len(todo)):
            store.append(run_prompt(model, p, pool, cfg, peers))
    else:
        row_costs = _row_costs(model, out, None)
    records = store.for_prompts(prompts, cfg.timed)
    failures = gate_failures(records) if cfg.greedy else []
    report = aggregate(records, cfg.timed, cfg.categories, row_costs)
    meta: dict[str, Any] = {
        "config": cfg.to_json(),
        "model_folder": str(model.folder),
        "model_variant": model.variant,
        "data": str(data),
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
