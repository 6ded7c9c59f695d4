"""Helpers for tests that drive the serving scheduler directly."""

from __future__ import annotations

import threading

from dejavuu_build.serve.scheduler import Request


def run_all(sched, jobs, timeout: float = 120):
    """Submit every (ids, DecodeSettings) at once; wait for all; return the results in order."""
    out, done = [None] * len(jobs), threading.Event()
    left = [len(jobs)]
    lock = threading.Lock()

    def finish(i):
        def on_done(r):
            out[i] = r
            with lock:
                left[0] -= 1
                if not left[0]:
                    done.set()

        return on_done

    for i, (ids, prm) in enumerate(jobs):
        sched.submit(Request(ids, prm, lambda t: None, finish(i)))
    assert done.wait(timeout)
    return out


def assert_batched_equal_alone(model, prompts, temperature: float, timeout: float = 300) -> None:
    """Every method side by side in ``model``'s batched serving graph (chains and trees in turn,
    prompts of different lengths) gets the tokens each request gets alone, and the requests really
    shared forwards."""
    from dejavuu_build.runtime.drafters import METHODS
    from dejavuu_build.runtime.settings import DecodeSettings
    from dejavuu_build.serve.scheduler import Result, Scheduler

    sched = Scheduler(model, max_batch=8)
    try:
        assert sched.batched, sched.why_sequential
        jobs = []
        for i, method in enumerate(METHODS):
            prm = DecodeSettings(
                max_new_tokens=20 + 3 * i, temperature=temperature, seed=3 + i, method=method, tree=i % 2 == 1
            )
            jobs.append((model.encode(prompts[i % len(prompts)] * (1 + i % 3)), prm))
        out = run_all(sched, jobs, timeout=timeout)
        for (ids, prm), r in zip(jobs, out):
            assert isinstance(r, Result) and r.batched, r
            alone = model.generate(
                ids, method="baseline", max_new_tokens=prm.max_new_tokens, temperature=temperature, seed=prm.seed
            )
            assert r.tokens == alone.tokens, (prm.method, prm.tree)
        assert sched.metrics.shared_forwards > 0  # requests really shared forwards
    finally:
        sched.close()
