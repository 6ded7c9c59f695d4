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


@contextmanager
def step(name: str) -> Iterator[StepTimer]:
    """Log the start and the duration of a long build step."""
    t = StepTimer()
    logger.info("▶ %s …", name)
    t0 = time.perf_counter()
    try:
        yield t
    finally:
        t.seconds = time.perf_counter() - t0
        logger.info("  %s done in %.1fs", name, t.seconds)


def progress(iterable, desc: str, total: int | None = None):
    """A tqdm bar on stderr when tqdm is available, else the iterable unchanged."""
    try:
        from tqdm import tqdm
    except ImportError:  # the runtime does not depend on tqdm
        return iterable
    return tqdm(iterable, desc=desc, total=total, file=sys.stderr, leave=False,
                disable=not logger.isEnabledFor(logging.INFO))
