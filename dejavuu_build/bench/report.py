"""Per category × method aggregates of the bench records, and their outputs (table, CSV, JSON, PNG).

Speedup compares decode time per decoded token of the same prompts in the same run, so
prefill (identical work for every method) neither dilutes nor inflates it; in greedy mode the
tokens are identical and it is exactly the ratio of decode times. The overall row takes the
geometric mean of the category speedups, so no category dominates by its length.

With peers (``--compare genai,llamacpp``, :mod:`.peer`), "× genai" is each method's decode tok/s
over the peer's on the same prompt (all turns of it), geo-meaned over the prompts of a category;
its overall row is the geo-mean of the categories, like the speedup's. Every peer gets such a
column: "× genai-ngram" over genai's own n-gram speculative decoding, "× llamacpp" and
"× llamacpp-lookup" over llama.cpp's plain decoding and prompt lookup. A speculative peer's row
also gives "vs plain": its token match with its own plain decoding (a peer's drafting is not
lossless by construction: it verifies drafts as multi-row forwards).

"oracle" is the copy-drafting bound of ``bench.oracle`` on the baseline's own answers at the row
costs measured in the same run: its tokens per step and speedup per category, and each method's
share of the oracle's gain, ``(speedup - 1) / (oracle speedup - 1)``. A method whose speedup is
below 1 by more than noise (``NOISE_FLOOR``, or twice the standard error of its per-prompt log
ratios to baseline) is flagged ``slower``; the bench calls it a failure for ``auto``, which must
never be slower than plain decoding.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Sequence

from ..log import logger
from .peer import PEER_METHODS, PLAIN_OF, column

OVERALL = "overall"
NOISE_FLOOR = 0.03  # a speedup within 3% of 1.0 is noise on any machine (log-ratio margin)
NOISE_ONE_PROMPT = 0.10  # the margin where one prompt gives no spread to measure
NEVER_SLOWER = ("auto",)  # methods that must never be slower than baseline (the bench flags them)


@dataclass
class Row:
    category: str
    method: str
    prompts: int
    generations: int
    tokens: int
    decode_tok_s_mean: float
    decode_tok_s_std: float
    speedup: float | None
    prefill_ms: float
    acceptance_rate: float | None  # None: nothing was drafted (baseline)
    tokens_per_step: float
    draft_ms_per_step: float
    verify_ms_per_step: float
    overhead_ms_per_step: float
    match_pct: float
    # decode tok/s over each peer's on the same prompts (geo-mean), by the peer's method name; the
    # results' columns are x_<peer> (peer.column); a peer not run has none
    x_peer: dict[str, float | None] = field(default_factory=dict)
    match_plain_pct: float | None = None  # a speculative peer: % of its tokens equal to its own plain decoding's
    top1_vs_fp32: float | None = None  # the quality gate: teacher-forced top-1 agreement with our fp32 export
    kl_vs_fp32: float | None = None  # and mean KL(fp32 || variant or peer); None: not measured
    ttft_ms: float = 0.0  # time to first token: a turn's prompt in, its first token out (mean)
    oracle_tokens_per_step: float | None = None  # the copy oracle's (bench.oracle) on the baseline's answers
    oracle_speedup: float | None = None  # ... and its speedup at the run's measured row costs
    oracle_share: float | None = None  # this method's share of the oracle's gain: (speedup - 1) / (oracle - 1)
    slower: bool | None = None  # speedup below 1 by more than noise (None: baseline, or no speedup)
    noise: float | None = None  # the speedup's noise margin (relative), from its per-prompt ratios


@dataclass
class Report:
    rows: list[Row]
    methods: tuple[str, ...]
    categories: tuple[str, ...]
    files: dict[str, Path] = field(default_factory=dict)  # what write_outputs wrote

    def row(self, category: str, method: str) -> Row | None:
        return next((r for r in self.rows if r.category == category and r.method == method), None)

    @property
    def peers(self) -> list[str]:
        """The peers this report has columns for, in run order."""
        return [m for m in self.methods if m in PEER_METHODS and any(r.x_peer.get(m) for r in self.rows)]

    def x(self, category: str, method: str, peer: str) -> float | None:
        """``method``'s decode tok/s over ``peer``'s in ``category`` (None: not run)."""
        row = self.row(category, method)
        return row.x_peer.get(peer) if row else None

    @property
    def has_quality(self) -> bool:
        return any(r.top1_vs_fp32 is not None for r in self.rows)

    @property
    def has_oracle(self) -> bool:
        return any(r.oracle_speedup is not None for r in self.rows)

    def slower(self, methods: Sequence[str] = NEVER_SLOWER) -> list[Row]:
        """Rows of ``methods`` (default: those that must never lose to plain decoding) flagged slower."""
        return [r for r in self.rows if r.method in methods and r.slower]

    def table(self) -> str:
        peers, qual, orc = self.peers, self.has_quality, self.has_oracle
        spec = any(p in PLAIN_OF for p in peers)
        head = (
            f"{'category':<15} {'method':<16} {'n':>3} {'decode tok/s':>17} {'speedup':>8} "
            + "".join(f"{'× ' + p:>{max(8, len(p) + 2)}} " for p in peers)
            + (f"{'vs plain':>8} " if spec else "")
            + (f"{'top-1/KL vs fp32':>17} " if qual else "")
            + (f"{'oracle':>13} {'share':>6} " if orc else "")
            + f"{'TTFT ms':>10} {'accept':>7} {'tok/step':>8} {'draft/verify/other ms':>22} {'match':>7}"
        )
        lines = [head, "-" * len(head)]
        for r in self.rows:
            split = f"{r.draft_ms_per_step:.2f}/{r.verify_ms_per_step:.2f}/{r.overhead_ms_per_step:.2f}"
            speed = "-" if r.speedup is None else f"{r.speedup:.2f}x" + ("!" if r.slower else "")
            oc = "-" if r.oracle_speedup is None else f"{r.oracle_tokens_per_step:.2f}t {r.oracle_speedup:.2f}x"
            sh = "-" if r.oracle_share is None else f"{100 * r.oracle_share:.0f}%"
            xs = "".join(
                f"{'-' if (v := r.x_peer.get(p)) is None else f'{v:.2f}x':>{max(8, len(p) + 2)}} " for p in peers
            )
            mg = "-" if r.match_plain_pct is None else f"{r.match_plain_pct:.1f}%"
            accept = "-" if r.acceptance_rate is None else f"{100 * r.acceptance_rate:.1f}%"
            qv = "-" if r.top1_vs_fp32 is None else f"{r.top1_vs_fp32:.3f}/{r.kl_vs_fp32:.4f}"
            lines.append(
                f"{r.category:<15} {r.method:<16} {r.prompts:>3} "
                f"{f'{r.decode_tok_s_mean:.1f} ± {r.decode_tok_s_std:.1f}':>17} {speed:>8} "
                + xs
                + (f"{mg:>8} " if spec else "")
                + (f"{qv:>17} " if qual else "")
                + (f"{oc:>13} {sh:>6} " if orc else "")
                + f"{r.ttft_ms:>10.1f} {accept:>7} {r.tokens_per_step:>8.2f} {split:>22} "
                f"{r.match_pct:>6.1f}%"
            )
        if flagged := self.slower():
            lines.append(
                "! slower than baseline by more than noise: "
                + ", ".join(
                    f"{r.method} on {r.category} ({r.speedup:.2f}x, noise ±{100 * (r.noise or 0):.0f}%)"
                    for r in flagged
                )
            )
        elif any(r.slower for r in self.rows):
            lines.append("! = slower than baseline by more than noise")
        return "\n".join(lines)


def _decode_tokens(r: dict) -> int:
    """Tokens made by decode steps: the first new token comes out of prefill."""
    return max(r["tokens"] - 1, 0)


def prompt_rates(recs: Sequence[dict]) -> dict[str, float]:
    """Decode tok/s per prompt (all its turns together), as ``decode_tok_s_mean`` averages them."""
    per_prompt: dict[str, list[dict]] = defaultdict(list)
    for r in recs:
        per_prompt[r["qid"]].append(r)
    return {
        q: sum(map(_decode_tokens, g)) / s for q, g in per_prompt.items() if (s := sum(r["decode_s"] for r in g)) > 0
    }


def x_peer(recs: Sequence[dict], peer: Sequence[dict]) -> float | None:
    """Geo-mean over the prompts both ran of (decode tok/s) / (the peer's decode tok/s)."""
    mine, theirs = prompt_rates(recs), prompt_rates(peer)
    return geomean([mine[q] / theirs[q] for q in mine if theirs.get(q)])


def _time_per_token(recs: Sequence[dict]) -> float | None:
    n = sum(_decode_tokens(r) for r in recs)
    return sum(r["decode_s"] for r in recs) / n if n else None


def _row(category: str, method: str, recs: Sequence[dict], base: Sequence[dict]) -> Row:
    per_prompt = {r["qid"] for r in recs}
    rates = list(prompt_rates(recs).values())
    t_m, t_b = _time_per_token(recs), _time_per_token(base)
    steps = sum(r["steps"] for r in recs)
    drafted = sum(r["drafted"] for r in recs)
    compared = sum(r["compared"] for r in recs)
    vs_plain = [r for r in recs if r.get("plain_compared") is not None]  # a speculative peer's records only

    def per_step(key: str) -> float:
        return 1e3 * sum(r[key] for r in recs) / steps if steps else 0.0

    return Row(
        category=category,
        method=method,
        prompts=len(per_prompt),
        generations=len(recs),
        tokens=sum(r["tokens"] for r in recs),
        decode_tok_s_mean=statistics.fmean(rates) if rates else 0.0,
        decode_tok_s_std=statistics.stdev(rates) if len(rates) > 1 else 0.0,
        speedup=t_b / t_m if t_m and t_b else None,
        prefill_ms=1e3 * statistics.fmean(r["prefill_s"] for r in recs) if recs else 0.0,
        ttft_ms=1e3 * statistics.fmean(r["prefill_s"] for r in recs) if recs else 0.0,
        acceptance_rate=sum(r["accepted"] for r in recs) / drafted if drafted else None,
        tokens_per_step=sum(map(_decode_tokens, recs)) / steps if steps else 0.0,
        draft_ms_per_step=per_step("draft_s"),
        verify_ms_per_step=per_step("verify_s"),
        overhead_ms_per_step=per_step("overhead_s"),
        match_pct=100.0 * sum(r["common_prefix"] for r in recs) / compared if compared else 100.0,
        match_plain_pct=(
            100.0 * sum(r["plain_common_prefix"] for r in vs_plain) / max(sum(r["plain_compared"] for r in vs_plain), 1)
        )
        if vs_plain
        else None,
    )


def geomean(values: Sequence[float]) -> float | None:
    vals = [v for v in values if v and v > 0]
    return math.exp(statistics.fmean(math.log(v) for v in vals)) if vals else None


def noise_margin(recs: Sequence[dict], base: Sequence[dict]) -> float:
    """The relative margin within which a speedup is noise: twice the standard error of the
    per-prompt log ratios of decode tok/s to baseline's (at least ``NOISE_FLOOR``)."""
    mine, theirs = prompt_rates(recs), prompt_rates(base)
    logs = [math.log(mine[q] / theirs[q]) for q in mine if mine[q] > 0 and theirs.get(q)]
    if len(logs) < 2:
        return NOISE_ONE_PROMPT
    se = statistics.stdev(logs) / math.sqrt(len(logs))
    return max(NOISE_FLOOR, math.expm1(2 * se))


def flag_slower(row: Row, margin: float) -> None:
    row.noise = margin
    row.slower = row.speedup is not None and row.speedup < 1.0 / (1.0 + margin)


def oracle_of(base: Sequence[dict], cost: dict[int, float] | None) -> tuple[float, float] | None:
    """(tokens per step, speedup) of the copy oracle over these baseline records, at ``cost``
    (relative row costs), or None without the runs (records from before the oracle) or costs."""
    from .oracle import plan

    if not cost or not base or any("oracle_runs" not in r for r in base):
        return None
    steps = tokens = 0
    spent = 0.0
    for r in base:
        n, c = plan(r["oracle_runs"], cost)
        steps, spent, tokens = steps + n, spent + c, tokens + _decode_tokens(r)
    return (tokens / steps, tokens / spent) if steps and spent else None


def _set_oracle(row: Row, oracle: tuple[float, float] | None, share: bool = True) -> None:
    """The oracle's columns on ``row``, and its share of the oracle's gain unless ``share`` is off (a
    peer: its speedup over our baseline comes from other kernels, not from drafting our copies)."""
    if oracle is None:
        return
    row.oracle_tokens_per_step, row.oracle_speedup = oracle
    if share and row.speedup is not None and oracle[1] > 1.0:
        row.oracle_share = (row.speedup - 1.0) / (oracle[1] - 1.0)


def aggregate(
    records: Sequence[dict],
    methods: Sequence[str],
    categories: Sequence[str],
    row_costs: dict[int, float] | None = None,
) -> Report:
    """Rows per category (in the asked order) × method, then the overall rows.

    For each peer in ``methods`` with records (``genai``, ``llamacpp-lookup`` …), every row gets its
    ratio in ``x_peer[peer]``.
    ``row_costs`` (seconds of a step of R graph rows, ``bench.oracle.measure_row_costs``) adds the
    copy oracle's bound and each method's share of it, where the baseline records carry its runs.
    """
    from .oracle import relative_costs

    cost = relative_costs(row_costs) if row_costs and 1 in row_costs else None
    oracles: dict[str, tuple[float, float] | None] = {}
    by: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in records:
        by[r["category"], r["method"]].append(r)
    cats = [c for c in categories if by.get((c, "baseline"))]
    have = {r["method"] for r in records}
    peers = [m for m in methods if m in PEER_METHODS and m in have]
    rows = []
    for c in cats:
        for m in methods:
            if by.get((c, m)):
                row = _row(c, m, by[c, m], by[c, "baseline"])
                for pm in peers:
                    row.x_peer[pm] = x_peer(by[c, m], by[c, pm])
                if m != "baseline" and m not in PEER_METHODS:
                    flag_slower(row, noise_margin(by[c, m], by[c, "baseline"]))
                oracles.setdefault(c, oracle_of(by[c, "baseline"], cost))
                _set_oracle(row, oracles[c], share=m not in PEER_METHODS)
                rows.append(row)
    for m in methods:
        mine = [r for r in records if r["method"] == m]
        if not mine:
            continue
        row = _row(OVERALL, m, mine, [r for r in records if r["method"] == "baseline"])
        row.speedup = geomean([r.speedup for r in rows if r.method == m and r.speedup])
        for pm in peers:
            row.x_peer[pm] = geomean([v for r in rows if r.method == m and (v := r.x_peer.get(pm))])
        if m != "baseline" and m not in PEER_METHODS:
            flag_slower(row, noise_margin(mine, [r for r in records if r["method"] == "baseline"]))
        known = [o for c in cats if (o := oracles.get(c))]
        if known and len(known) == len(cats):
            _set_oracle(
                row,
                (geomean([o[0] for o in known]) or 0.0, geomean([o[1] for o in known]) or 0.0),
                share=m not in PEER_METHODS,
            )
        rows.append(row)
    return Report(rows, tuple(methods), tuple(cats))


# ---------------------------------------------------------------------------------- outputs
def _flat(row: Any, peers: Sequence[str]) -> dict:
    """A row as one flat dict: a report row's ``x_peer`` as one ``x_<peer>`` column per peer."""
    d = asdict(row)
    if "x_peer" in d:
        x = d.pop("x_peer")
        d.update({column(p): x.get(p) for p in peers})
    return d


def write_rows(paths: dict[str, Path], rows: Sequence, row_type: type, meta: dict, peers: Sequence[str] = ()) -> None:
    """``paths["csv"]`` (one line per dataclass row) and ``paths["json"]`` (run metadata + rows)."""
    names = [fl.name for fl in fields(row_type)]
    if "x_peer" in names:
        at = names.index("x_peer")
        names[at : at + 1] = [column(p) for p in peers]
    flat = [_flat(r, peers) for r in rows]
    with paths["csv"].open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=names)
        w.writeheader()
        w.writerows(flat)
    paths["json"].write_text(json.dumps({**meta, "rows": flat}, indent=2) + "\n")


def variant_quality(folder: str | Path, variant: str) -> dict | None:
    """The quality gate the build recorded for ``variant`` (top-1 and KL vs fp32), if any."""
    from ..schema import read_manifest

    try:
        rec = read_manifest(folder).variants.get(variant)
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return (rec.gates.get("quality") if rec else None) or None


def add_quality(report: Report, quality: dict | None, peers: dict[str, dict | None] | None = None) -> None:
    """Quality next to speed: our variant's on every row of ours, each peer's own (scored by the same
    gate, ``peer.peer_quality``; a speculative peer shares its plain one's model) on its rows."""
    peers = peers or {}
    for r in report.rows:
        q = peers.get(r.method) or peers.get(PLAIN_OF.get(r.method, "")) if r.method in PEER_METHODS else quality
        if q:
            r.top1_vs_fp32, r.kl_vs_fp32 = q["top1"], q["mean_kl"]


def write_outputs(report: Report, out: Path, meta: dict) -> dict[str, Path]:
    """``results.csv``, ``results.json`` (rows + run metadata + gate) and ``speedup.png``."""
    paths = {"csv": out / "results.csv", "json": out / "results.json", "png": out / "speedup.png"}
    if "model_folder" in meta and "model_variant" in meta:
        add_quality(
            report,
            variant_quality(meta["model_folder"], meta["model_variant"]),
            {m: p.get("quality") for m, p in (meta.get("peers") or {}).items()},
        )
    write_rows(paths, report.rows, Row, meta, report.peers)
    try:
        model = f"{Path(meta['model_folder']).name} ({meta['model_variant']})"
        notes = {
            m: ", ".join(f"{k} {v}" for k, v in spec.items() if k != "as")
            for m, p in (meta.get("peers") or {}).items()
            if (spec := p.get("speculative"))
        }
        plot_speedups(report, paths["png"], title=f"{model}: decode speedup over baseline", notes=notes)
    except ImportError:
        logger.warning("matplotlib is not installed: no %s (pip install matplotlib)", paths["png"].name)
        del paths["png"]
    report.files = paths
    return paths


def bar_value(r: Row | None, key: str) -> float | None:
    """A bar's height: ``r``'s speedup (``key`` empty) or its ratio over peer ``key``; None where
    there is none (the method or the peer did not run there: genai's n-gram drafting on Gemma's long
    prompts), drawn as "n/a", not as a bar at zero."""
    if r is None:
        return None
    v = r.x_peer.get(key) if key else r.speedup
    return float(v) if v else None


def bar_label(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def plot_speedups(
    report: Report, path: Path, title: str = "speedup over baseline", notes: dict[str, str] | None = None
) -> None:
    """Grouped bars: one group per category (and overall), one bar per method, a line at 1.0x.

    Each peer adds a panel of every method's decode tok/s over that peer's (× genai, × genai-ngram,
    × llamacpp, × llamacpp-lookup); ``notes``: a speculative peer's options, under its title.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [*report.categories, OVERALL]
    panels = [
        (
            "",
            [m for m in report.methods if m != "baseline"],
            "decode speedup over baseline (×)",
            "baseline",
            title,
        )
    ]
    for p in report.peers:
        note = (notes or {}).get(p)
        panels.append(
            (
                p,
                [m for m in report.methods if m != p],
                f"decode tok/s over {p}'s (×)",
                p + (f" (speculative, vs its plain {PLAIN_OF[p]})" if p in PLAIN_OF else " (plain decoding)"),
                f"× {p}: same prompts, same token ids" + (f"\n({note})" if note else ""),
            )
        )

    colors = {m: f"C{i}" for i, m in enumerate(report.methods)}  # one color per method in both panels
    n_bars = max(len(p[1]) for p in panels)
    fig, axes = plt.subplots(
        len(panels), 1, squeeze=False, figsize=(max(7.0, 2.5 + 0.3 * len(groups) * max(1, n_bars)), 4.0 * len(panels))
    )
    for ax, (key, methods, ylabel, ref, ttl) in zip(axes[:, 0], panels):
        width = 0.8 / max(len(methods), 1)
        for i, m in enumerate(methods):
            got = [bar_value(report.row(g, m), key) for g in groups]
            xs = [j + (i - (len(methods) - 1) / 2) * width for j in range(len(groups))]
            bars = ax.bar(xs, [v or 0.0 for v in got], width, label=m, color=colors[m])
            ax.bar_label(bars, labels=[bar_label(v) for v in got], fontsize=7, padding=1)
        ax.axhline(1.0, color="black", linewidth=1, linestyle="--", label=ref)
        ax.set_xticks(range(len(groups)), groups, rotation=20, ha="right")
        ax.set_ylabel(ylabel)
        ax.set_title(ttl)
        ax.set_ylim(0, 1.15 * max([1.0, *(bar_value(r, key) or 0.0 for r in report.rows)]))
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
