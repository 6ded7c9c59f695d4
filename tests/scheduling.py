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
