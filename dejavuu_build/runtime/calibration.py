"""Machine-local exactness calibration: what this CPU, this onnxruntime and this graph need so
that speculative verification stays bit-identical to plain decoding.

Three facts are measured, never assumed (they differ between attention kernels, ORT versions
and CPUs):

* ``chain_exact``: N drafted tokens verified in one forward get logits bit-identical to N
  single (two-row padded) steps. Every drafter relies on it; a machine that fails it decodes
  plainly, with one warning, instead of losing exactness silently.
* ``period``: attention sums keys in SIMD blocks; a tree node whose ancestors sit at the same
  offsets modulo ``period`` as in a chain gets bit-identical logits (see tree.aligned_layout).
* ``tile``: some kernels also group keys in larger tiles; a node whose slot falls in another
  tile than its chain position is pruned. ``None`` when the kernel shows no such boundary.

The result is cached under ``<cache>/.runtime/`` keyed by graph, onnxruntime version, CPU flags
and thread count, and validated when read: a corrupted or out-of-range record is re-measured.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..log import logger
from .tree import aligned_layout, with_root

PERIODS = (4, 8, 16, 32, 64)
PERIOD_STREAMS = 6  # token streams a candidate period must hold on (_periods)
TILES = (None, 256, 128, 64, 32, 16)  # tried in this order: the least pruning first
# 3: periods searched on PERIOD_STREAMS streams; records of the 2-stream search are measured again
CALIBRATION_VERSION = 3


@dataclass
class Calibration:
    chain_exact: bool
    period: int | None
    tile: int | None
    seconds: float = 0.0
    version: int = CALIBRATION_VERSION

    @classmethod
    def from_json(cls, d: dict) -> "Calibration":
        """Parse and validate a cached record; ValueError if it is not one this code would write."""
        if not isinstance(d, dict) or d.get("version") != CALIBRATION_VERSION:
            raise ValueError("not a calibration record of this version")
        c = cls(chain_exact=d["chain_exact"], period=d["period"], tile=d["tile"], seconds=float(d.get("seconds", 0)))
        if not isinstance(c.chain_exact, bool) or c.period not in (None, *PERIODS) or c.tile not in TILES:
            raise ValueError(f"calibration values out of range: {d}")
        if c.period is not None and c.tile is not None and c.tile % c.period:
            raise ValueError(f"tile {c.tile} is not a multiple of period {c.period}")
        return c


def _tokens(dec, n: int, seed: int = 0) -> list[int]:
    v = dec.c.vocab_size or 100
    return [int(3 + (7 * i + (i * i) % 13 + 31 * seed) % max(v - 3, 1)) for i in range(n)]


def _limit(dec) -> int:
    return dec.capacity or dec.c.max_positions or 1 << 30


def _chain_exact(dec, pasts=(9, 13, 60, 250, 1020), rows=(2, 3, 5, 8)) -> bool:
    """Batched verify == single steps run as the runtime runs them, bit for bit, at short and
    boundary-crossing pasts. One prefill serves every past (descending: a step only overwrites
    rows at or after its past, with the same tokens)."""
    lim = _limit(dec)
    pasts = sorted((p for p in pasts if p + max(rows) + 2 < lim), reverse=True)
    if not pasts:
        return True
    toks = _tokens(dec, pasts[0] + max(rows) + 1)
    kv = dec.new_cache()
    try:
        _, _, pres = dec.forward(toks[: pasts[0]], None, kv)
        kv.commit(pres, pasts[0], list(range(pasts[0])))
        for past in pasts:
            kv.truncate(past)
            inc = []
            for t in toks[past : past + max(rows)]:
                li, _, pres = dec.forward([t], None, kv)
                kv.commit(pres, 1, [0])
                inc.append(li[0])
            kv.truncate(past)
            for n in rows:
                lb, _, _ = dec.forward(toks[past : past + n], None, kv)
                if not np.array_equal(lb, np.stack(inc[:n])):
                    return False
        return True
    finally:
        kv.release()


def _periods(dec, periods=PERIODS):
    """Candidate periods G, smallest first: nodes whose parent sits G, 2G or 3G masked slots earlier get
    logits bit-identical to the plain chain, at 16 consecutive pasts (every tail of the key loop)
    and PERIOD_STREAMS token streams: a wrong G can match by luck, and on int4 graphs often does
    (the int8 activations of the next product round a one-ulp attention difference away most of
    the time: on an AVX-512 EPYC a tiny Llama's int4 passed G=8 on two streams, its true period
    being 16); a right one never misses."""
    kv = dec.new_cache()
    chains: dict[tuple[int, int], np.ndarray] = {}  # (seed, past) -> the plain chain's logits, whatever the gap

    def exact(gap: int, seed: int) -> bool:
        toks = _tokens(dec, 64, seed)
        kv.truncate(0)  # earlier probes overwrote rows: prefill again
        _, _, pres = dec.forward(toks[:25], None, kv)
        kv.commit(pres, 25, list(range(25)))
        for past in range(24, 8, -1):  # descending: a step only overwrites rows >= past
            kv.truncate(past)
            a, b, c, d = toks[past : past + 4]
            if (seed, past) not in chains:
                chains[seed, past] = dec.forward([a, b, c, d], None, kv)[0]
            chain = chains[seed, past]
            # b hangs off a after `gap` pads; c off b directly; d off c after 2*gap pads (depth 3)
            nodes = [a] + [a] * gap + [b, c] + [a] * (2 * gap) + [d]
            parents = [-1] + [-1] * gap + [0, gap + 1] + [-1] * (2 * gap) + [gap + 2]
            out, _, _ = dec.forward(nodes, parents, kv)
            if not (
                np.array_equal(out[gap + 1], chain[1])
                and np.array_equal(out[gap + 2], chain[2])
                and np.array_equal(out[-1], chain[3])
            ):
                return False
        return True

    try:
        for g in periods:
            if 25 + 3 * g + 4 < _limit(dec) and all(
                exact(k * g, seed) for seed in range(PERIOD_STREAMS) for k in (1, 2)
            ):
                yield g
    finally:
        kv.release()


def _tile(dec, period: int, tiles=TILES) -> tuple[bool, int | None]:
    """(found, tile): the least-pruning tile rule under which a two-branch tree laid out by
    aligned_layout matches its chains bit for bit at pasts just before 64..1024-key boundaries.
    Tile rules are tried in order, each at every past until one fails: the first that holds
    everywhere is the answer, and the rules after it are never run."""
    lim = _limit(dec)
    toks = _tokens(dec, 1100)
    draft_parents = [-1, -1, 0, 1, 2]  # two branches: 1-3-5 first-child path, 2-4
    parents = with_root(draft_parents)
    paths = {1: [0, 1], 2: [0, 2], 3: [0, 1, 3], 4: [0, 2, 4], 5: [0, 1, 3, 5]}
    pasts = [b - o for b in (64, 128, 256, 512, 1024) for o in (1, 3, 8) if b + 2 * period + 8 < lim]
    if not pasts:
        return True, None
    kv = dec.new_cache()
    top = max(pasts)
    chains: dict[int, dict[int, np.ndarray]] = {}  # past -> node -> its chain's logits
    try:
        _, _, pres = dec.forward(toks[:top], None, kv)
        kv.commit(pres, top, list(range(top)))
        # a forward writes the rows at and after its past (in place); the prefilled cache is put
        # back before the next rule walks the pasts again from the top
        saved = _snapshot(kv, top)
        step = toks[top : top + 6]

        def holds(tile: int | None, past: int) -> bool:
            kv.truncate(past)
            if past not in chains:
                chains[past] = {}
                for leaf in (5, 4):
                    out, _, _ = dec.forward([step[i] for i in paths[leaf]], None, kv)
                    for d, node in enumerate(paths[leaf]):
                        chains[past][node] = out[d]
            slot, slot_parents = aligned_layout(parents, period, 2 * period, past=past, tile=tile)
            kept = [i for i, s_ in enumerate(slot) if s_ >= 0]  # as the engine feeds it
            out, _, _ = dec.forward([step[i] for i in kept], slot_parents, kv, slots=[slot[i] for i in kept])
            return all(np.array_equal(out[j], chains[past][i]) for j, i in enumerate(kept) if i)

        for n, tile in enumerate(tiles):
            if n:
                _restore(kv, saved)
            # descending: a forward only overwrites rows >= past
            if all(holds(tile, past) for past in sorted(pasts, reverse=True)):
                return True, tile  # the first that held (None, no tile rule, is one of them)
        return False, None
    finally:
        kv.release()


def _snapshot(kv, rows: int) -> tuple:
    """What a cache holds of its first ``rows`` rows, to be put back by _restore: an in-place
    buffer's rows (forwards overwrite them), or a concat cache's arrays (never written in place)."""
    buf = getattr(kv, "buf", None)
    if buf is not None:
        return kv.length, buf[:, :, :, :rows].copy(), None
    return kv.length, None, dict(kv.arrays)


def _restore(kv, snap: tuple) -> None:
    length, rows, arrays = snap
    if rows is not None:
        kv.buffers()[:, :, :, : rows.shape[3]] = rows
    else:
        kv.arrays = dict(arrays)
    kv.length = length


def calibrate(dec, hint: Calibration | None = None) -> Calibration:
    """Measure chain exactness, then the tree period and tile. ``hint``: a calibration of another
    graph with the same attention (the build: another precision of this layout): its period and
    tile are checked first, and only searched for when they fail here."""
    t0 = time.perf_counter()
    chain = _chain_exact(dec)
    period = tile = None
    # rowwise graphs: the one-row kernels group keys in blocks that start at key 0, so a branch
    # node never shares its block with the same keys as in a chain (measured: docs/exactness.md):
    # they verify chains only, and the search is skipped
    if chain and dec.c.tree_capable and not dec.rowwise:
        found = False
        if hint is not None and hint.period is not None:
            if next(_periods(dec, (hint.period,)), None) is not None:
                found, tile = _tile(dec, hint.period, (hint.tile,))
                period = hint.period if found else None
        if not found:
            # a period exact on short rows may still fail on long ones (some kernels change their
            # key blocking with the row length): the first candidate that also passes the
            # long-row tree probe under some tile rule wins
            for g in _periods(dec):
                found, tile = _tile(dec, g)
                if found:
                    period = g
                    break
            else:
                tile = None
    return Calibration(chain, period, tile, round(time.perf_counter() - t0, 2))


def calibration_key(graph_id: str, threads: int) -> str:
    import onnxruntime

    flags = ""
    try:
        flags = next((ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")), "")
    except OSError:
        pass
    return hashlib.sha256(
        f"{graph_id}|{onnxruntime.__version__}|{platform.machine()}|{platform.processor()}|"
        f"{flags}|{threads}|v{CALIBRATION_VERSION}".encode()
    ).hexdigest()[:24]


def spot_check(dec) -> bool:
    """A cheap re-check of a recorded ``chain_exact``: one short past, verifies of 2 and 5 rows
    against single steps (a few forwards). A record that claims exactness where this fails would
    lose it, so it is never trusted over the measurement."""
    return _chain_exact(dec, pasts=(11,), rows=(2, 5))


def cached_calibration(dec, graph_id: str, threads: int, folder: Path) -> Calibration:
    """calibrate(), remembered in ``folder/calibration-<key>.json`` (the build writes it for the
    machine it ran on: record_calibration); invalid records, and records whose exactness claim
    fails the spot check, are re-measured, with a line on screen (it takes seconds)."""
    f = folder / f"calibration-{calibration_key(graph_id, threads)}.json"
    try:
        cal = Calibration.from_json(json.loads(f.read_text()))
        if not cal.chain_exact or spot_check(dec):
            return cal
        logger.warning(
            "the exactness calibration %s claims exact verification, which this machine contradicts: measuring again", f
        )
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError) as e:
        logger.warning("ignoring an invalid exactness calibration %s (%s): measuring again", f, e)
    logger.info("measuring decoding exactness of this decoder on this machine (once; seconds) …")
    cal = calibrate(dec)
    logger.info(
        "  exactness: verify %s, tree period %s, tile %s (%.1fs)",
        "exact" if cal.chain_exact else "NOT exact (plain decoding)",
        cal.period,
        cal.tile,
        cal.seconds,
    )
    _save(f, cal)
    return cal


def record_calibration(dec, graph_id: str, threads: int, folder: Path, hint: Calibration | None = None) -> dict:
    """The build's calibration of a variant on the machine it runs on, written where the runtime
    looks first (so the first ``generate`` measures nothing) and returned for the manifest."""
    cal = calibrate(dec, hint)
    key = calibration_key(graph_id, threads)
    _save(folder / f"calibration-{key}.json", cal)
    return {"key": key, "threads": threads, **asdict(cal)}


def _save(f: Path, cal: Calibration) -> None:
    logger.debug("exactness calibration: %s", cal)
    try:
        f.parent.mkdir(parents=True, exist_ok=True)
        tmp = f.with_name(f"{f.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(cal)))
        os.replace(tmp, f)
    except OSError:
        pass
