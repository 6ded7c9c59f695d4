"""`bench --contexts N --anatomy`: where a one-token decode step goes, by op type, against genai's graphs.

Each system's decode steps run under onnxruntime's profiler at the sweep's first context: ours is
plain decoding through the same Model the sweep times (its default variant, its layout's driver),
each genai build's (``--compare genai``, ``genai-int8``) is its own graph replayed under plain
onnxruntime at genai's shapes (bench.genai.GenaiReplay).
From the profile, per op type: the nodes a step runs (kernel events per run: what onnxruntime
executes after its own optimisation, so it is the "nodes per step" both runtimes pay) and their
kernel time per step. Why one thread: kernel time is then CPU time, which a shared machine disturbs
least; read the shares and the ratio, not the milliseconds (docs/speed.md).
"""

from __future__ import annotations

import json
import statistics
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..log import logger

ANATOMY_FILES = {"csv": "anatomy.csv", "json": "anatomy.json", "png": "anatomy.png"}
THREADS = 1
STEPS = 24
TOTAL = "total"


@dataclass
class OpRow:
    system: str  # baseline (ours) | a genai peer: genai, genai-int8
    op: str  # op type, or "total"
    nodes_per_step: int
    kernel_ms_per_step: float
    share: float  # of the system's kernel time per step


def read_profile(path: str | Path, runs: int) -> dict[str, tuple[int, float]]:
    """op type -> (nodes per run, kernel ms per run) over the LAST ``runs`` model runs of an
    onnxruntime profile (earlier runs: prefill, warm-up). Node counts are the median per run; a
    profile holding fewer runs is refused (the caller ran fewer steps than it said)."""
    events = json.loads(Path(path).read_text())
    windows = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "model_run")
    if len(windows) < runs or runs < 1:
        raise ValueError(f"{path}: {len(windows)} runs profiled, {runs} wanted")
    windows = windows[-runs:]
    counts: dict[str, list[int]] = defaultdict(lambda: [0] * runs)
    times: dict[str, float] = defaultdict(float)
    starts = [w[0] for w in windows]
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        ts = e["ts"]
        i = max((k for k, s in enumerate(starts) if s <= ts), default=None)
        if i is None or ts > windows[i][1]:
            continue
        op = e.get("args", {}).get("op_name", "?")
        counts[op][i] += 1
        times[op] += e["dur"] / 1e3
    return {op: (int(statistics.median(counts[op])), times[op] / runs) for op in counts}


def _rows(system: str, ops: dict[str, tuple[int, float]]) -> list[OpRow]:
    total = sum(ms for _, ms in ops.values()) or 1.0
    rows = [
        OpRow(system, op, n, ms, ms / total) for op, (n, ms) in sorted(ops.items(), key=lambda kv: (-kv[1][1], kv[0]))
    ]
    rows.append(OpRow(system, TOTAL, sum(r.nodes_per_step for r in rows), sum(r.kernel_ms_per_step for r in rows), 1.0))
    return rows


def profile_ours(model, prompt: Sequence[int], steps: int, tmp: Path) -> tuple[dict[str, tuple[int, float]], list[int]]:
    """Plain decoding of ``steps`` tokens after ``prompt`` on ``model``'s own variant file, one
    thread, profiled (the decode runs only); returns the profile and the tokens decoded."""
    from ..runtime.decoder import Decoder
    from ..runtime.session import make_session
    from ..runtime.settings import DecodeSettings

    if model.path is None:
        raise ValueError("the model was not opened from a file: nothing to profile")
    sess = make_session(model.path, THREADS, profile=str(tmp / "ours"))
    mine = model.decoder
    model.decoder = Decoder(sess, model.contract, mine.embed)
    try:
        res = model.generate(list(prompt), DecodeSettings(max_new_tokens=steps + 1))
    finally:
        model.decoder = mine
    return read_profile(sess.end_profiling(), res.stats.steps), res.tokens[:steps]


def profile_genai(
    folder: Path, prompt: Sequence[int], tokens: Sequence[int], tmp: Path, name: str = "genai"
) -> dict[str, tuple[int, float]]:
    """genai's graph under plain onnxruntime: the prompt, then one decode run per token of ``tokens``."""
    from .genai import GenaiReplay

    replay = GenaiReplay(folder, THREADS, profile=str(tmp / name))
    replay.prefill(prompt, len(prompt) + len(tokens) + 1)
    for t in tokens:
        replay.step(t)
    return read_profile(replay.sess.end_profiling(), len(tokens))


@dataclass
class Anatomy:
    context: int
    steps: int
    rows: list[OpRow]
    files: dict

    def total(self, system: str) -> OpRow | None:
        return next((r for r in self.rows if r.system == system and r.op == TOTAL), None)

    def ratio(self, peer: str = "genai") -> tuple[float | None, float | None]:
        """(nodes, kernel ms) of ours over ``peer``'s per step; None without it."""
        ours, g = self.total("baseline"), self.total(peer)
        if ours is None or g is None or not g.nodes_per_step or not g.kernel_ms_per_step:
            return None, None
        return ours.nodes_per_step / g.nodes_per_step, ours.kernel_ms_per_step / g.kernel_ms_per_step

    def table(self) -> str:
        systems = list(dict.fromkeys(r.system for r in self.rows))
        by = {(r.system, r.op): r for r in self.rows}
        ops = list(dict.fromkeys(r.op for r in self.rows if r.op != TOTAL)) + [TOTAL]
        head = f"{'op':<34}" + "".join(f"{s + ' nodes':>16}{s + ' ms':>14}{'share':>7}" for s in systems)
        lines = [f"one decode step at context {self.context} ({THREADS} thread, {self.steps} steps profiled)"]
        lines += [head, "-" * len(head)]
        for op in ops:
            cells = ""
            for s in systems:
                r = by.get((s, op))
                cells += (
                    f"{r.nodes_per_step:>16}{r.kernel_ms_per_step:>14.3f}{100 * r.share:>6.0f}%"
                    if r
                    else f"{'-':>16}{'-':>14}{'-':>7}"
                )
            lines.append(f"{op:<34}{cells}")
        for peer in systems[1:]:
            nodes, ms = self.ratio(peer)
            if nodes is not None:
                lines.append(f"ours / {peer} per step: {nodes:.2f}x nodes, {ms:.2f}x kernel time")
        return "\n".join(lines)


def run_anatomy(model, prompt: Sequence[int], out: Path, peers: Sequence[tuple[str, Path]], meta: dict) -> Anatomy:
    """Profile ours (and each ``(name, folder)`` genai build's graph) at ``prompt`` into
    ``out``/anatomy.{csv,json,png}."""
    from .report import write_rows

    steps = STEPS
    with tempfile.TemporaryDirectory(prefix="anatomy-") as d:
        tmp = Path(d)
        ours, tokens = profile_ours(model, prompt, steps, tmp)
        rows = _rows("baseline", ours)
        for name, folder in peers:  # the same tokens, decoded by each genai build's graph
            try:
                rows += _rows(name, profile_genai(folder, prompt, tokens, tmp, name))
            except Exception as e:  # noqa: BLE001 - the comparison is optional, our profile is not
                logger.warning("%s's step anatomy n/a: its graph did not run under plain onnxruntime (%s)", name, e)
    report = Anatomy(len(prompt), steps, rows, {})
    paths = {k: Path(out) / v for k, v in ANATOMY_FILES.items()}
    ratios = {name: report.ratio(name) for name, _ in peers}
    nodes, ms = report.ratio()
    write_rows(
        paths,
        rows,
        OpRow,
        {
            **meta,
            "context": len(prompt),
            "threads": THREADS,
            "steps": steps,
            "nodes_ratio": nodes,  # over genai's int4 build (None without it)
            "kernel_ms_ratio": ms,
            "ratios": {name: {"nodes": r[0], "kernel_ms": r[1]} for name, r in ratios.items()},
            "how": __doc__.split("\n\n")[1].replace("\n", " "),
        },
    )
    try:
        plot_anatomy(report, paths["png"])
    except ImportError:
        logger.warning("matplotlib is not installed: no %s (pip install matplotlib)", paths["png"].name)
        del paths["png"]
    report.files = paths
    return report


def plot_anatomy(report: Anatomy, path: Path) -> None:
    """One stacked bar per system: kernel ms per step by op type (the 8 largest, the rest as one)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = list(dict.fromkeys(r.system for r in report.rows))
    totals: dict[str, float] = defaultdict(float)
    for r in report.rows:
        if r.op != TOTAL:
            totals[r.op] += r.kernel_ms_per_step
    top = sorted(totals, key=lambda op: -totals[op])[:8]
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.8 * len(systems)))
    for i, s in enumerate(systems):
        left = 0.0
        ms = {r.op: r.kernel_ms_per_step for r in report.rows if r.system == s and r.op != TOTAL}
        parts = [(op, ms.get(op, 0.0)) for op in top] + [("other", sum(v for k, v in ms.items() if k not in top))]
        for j, (op, v) in enumerate(parts):
            ax.barh(i, v, left=left, color=f"C{j}", label=op if i == 0 else None)
            left += v
        t = report.total(s)
        ax.text(left, i, f"  {t.nodes_per_step} nodes" if t else "", va="center", fontsize=8)
    ax.set_yticks(range(len(systems)), ["ours" if s == "baseline" else s for s in systems])
    ax.set_xlabel(f"kernel ms per decode step ({THREADS} thread, context {report.context})")
    ax.legend(fontsize=7, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.35))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
