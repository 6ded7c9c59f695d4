"""One logger for the package, and a timed step helper that shows progress on stderr."""

from __future__ import annotations

import logging
import sys
import time
from contextlib import contextmanager
from typing import Iterator

logger = logging.getLogger("dejavuu")


def setup_logging(verbose: bool = False) -> None:
    if logger.handlers:
        logger.setLevel(logging.DEBUG if verbose else logging.INFO)
        return
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(h)
    logger.setLevel(logging.DEBUG if verbose else logging.INFO)
    logger.propagate = False


class StepTimer:
    def __init__(self) -> None:
        self.seconds = 0.0


_timelines: list[list[tuple[str, float]]] = []


@contextmanager
def timeline() -> Iterator[list[tuple[str, float]]]:
    """Collect ``(step, seconds)`` of every step() run inside (outermost steps only), so a build can
    record and print where its time went."""
    steps: list[tuple[str, float]] = []
    _timelines.append(steps)
    try:
        yield steps
    finally:
        _timelines.remove(steps)


_depth = 0


@contextmanager
def step(name: str) -> Iterator[StepTimer]:
    """Log the start and the duration of a long build step."""
    global _depth
    t = StepTimer()
    logger.info("▶ %s …", name)
    t0 = time.perf_counter()
    _depth += 1
    try:
        yield t
    finally:
        _depth -= 1
        t.seconds = time.perf_counter() - t0
        logger.info("  %s done in %.1fs", name, t.seconds)
        if _depth == 0:
            for steps in _timelines:
                steps.append((name, round(t.seconds, 1)))


def progress(iterable, desc: str, total: int | None = None):
    """A tqdm bar on stderr when tqdm is available, else the iterable unchanged."""
    try:
        from tqdm import tqdm
    except ImportError:  # the runtime does not depend on tqdm
        return iterable
    return tqdm(
        iterable, desc=desc, total=total, file=sys.stderr, leave=False, disable=not logger.isEnabledFor(logging.INFO)
    )
