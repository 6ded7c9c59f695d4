"""The scheduler: one worker thread that owns the model and steps every active request together.

Each loop: admit waiting requests into free batch slots, prefill the new ones (one prompt chunk
per forward, so a long prompt never stalls the others for long), then draft for every decoding
request and verify all their drafts in ONE forward of the batched graph (serve.batch). Each
request's tokens equal what it gives alone, because every request is fed the rows the
single-request decoder would feed it. Admission is bounded (``QueueFull`` -> HTTP 429); a
cancelled request (client gone) leaves at the next step boundary and its KV slot and drafter
are dropped at once.

Where the entry holds no gated batched graph (one built before the build wrote it, a variant
other than the one it was written for) or its rows are not bit-exact on this machine, requests
run one at a time through ``Model.generate`` (still exact, no batching), with one warning.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Callable

import numpy as np

from .. import schema as S
from ..errors import DejavuuError
from ..layouts import BatchDriver, Rows
from ..log import logger
from ..runtime.job import GenerationStats, Job
from ..runtime.settings import DecodeSettings
from .batch import BatchUnavailable, check_exact, open_batch
from .memory import MEMORY_METHODS, Memory, with_memory

if TYPE_CHECKING:
    from ..runtime.model import Model


class QueueFull(DejavuuError):
    """More requests are waiting than the server admits (HTTP 429)."""


class Cancelled(DejavuuError):
    """The request was cancelled (its client disconnected)."""


@dataclass
class Result:
    tokens: list[int]
    prompt_tokens: int
    stop_reason: str
    stats: GenerationStats
    method: str
    tree: bool
    batched: bool


class Request:
    """A submitted request: ``ids`` decoded under ``settings`` (built and checked where the request
    came in: serve.app), its drafter memory in ``namespace``. The worker calls ``on_tokens`` with each
    step's committed ids and ``on_done`` once with a Result or an exception (both from the worker
    thread)."""

    _ids = itertools.count()

    def __init__(
        self,
        ids: list[int],
        settings: DecodeSettings,
        on_tokens: Callable[[list[int]], object],
        on_done: Callable[[Result | BaseException], object],
        prefill_embeds: np.ndarray | None = None,
        namespace: str = "default",
    ):
        self.id = next(self._ids)
        self.ids, self.settings, self.namespace = ids, settings, namespace
        self.on_tokens, self.on_done = on_tokens, on_done
        self.prefill_embeds = prefill_embeds
        self.cancelled = False
        self.t_submit = time.perf_counter()
        self.job: Job | None = None
        self.slot = -1

    def cancel(self) -> None:
        """Ask the worker to drop this request at its next step boundary."""
        self.cancelled = True

    @property
    def running(self) -> Job:
        """The request's Job, which the batched path makes when it admits the request."""
        if self.job is None:
            raise RuntimeError(f"request {self.id} was not admitted: it has no job yet")
        return self.job


class Metrics:
    """Plain counters the /metrics endpoint renders (written by the worker thread only)."""

    def __init__(self):
        self.requests = {"ok": 0, "error": 0, "cancelled": 0, "rejected": 0}
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.forwards = 0
        self.forward_s = 0.0
        self.batch_rows = 0
        self.shared_forwards = 0  # forwards that verified two or more requests at once
        self.drafted: dict[str, int] = {}
        self.accepted: dict[str, int] = {}
        self.steps: dict[str, int] = {}
        self.recent: deque[tuple[float, int]] = deque()  # (time, tokens) for tokens/s over 10 s

    def add_tokens(self, n: int) -> None:
        now = time.perf_counter()
        self.completion_tokens += n
        self.recent.append((now, n))
        while self.recent and self.recent[0][0] < now - 10.0:
            self.recent.popleft()

    def tokens_per_s(self) -> float:
        now = time.perf_counter()
        while self.recent and self.recent[0][0] < now - 10.0:
            self.recent.popleft()
        return sum(n for _, n in self.recent) / 10.0


class Scheduler:
    def __init__(
        self,
        model: Model,
        *,
        max_batch: int = S.DEFAULT_MAX_BATCH,
        max_queue: int = S.DEFAULT_MAX_QUEUE,
        batch: bool = True,
        memory: Memory | None = None,
        datastore=None,
    ):
        if max_batch < 1 or max_queue < 0:
            raise DejavuuError("max_batch must be >= 1 and max_queue >= 0")
        self.model = model
        self.max_queue = max_queue
        self.memory = memory
        self.datastore = datastore
        self.metrics = Metrics()
        self.batch: BatchDriver[Request] | None = None
        self.why_sequential = "batching off (--no-batch)"
        if batch:
            try:
                self.batch = open_batch(model, max_batch)
                if not check_exact(model.decoder, self.batch):
                    self.batch = None
                    self.why_sequential = "the batched graph's rows are not bit-identical to single requests here"
            except BatchUnavailable as e:
                self.why_sequential = str(e)
        if self.batch is None:
            logger.warning("serving one request at a time (%s)", self.why_sequential)
        self.max_batch = max_batch if self.batch else 1
        self._waiting: deque[Request] = deque()
        self._active: list[Request] = []
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="dejavuu-scheduler", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ API (any thread)
    @property
    def batched(self) -> bool:
        return self.batch is not None

    def queue_depth(self) -> int:
        return len(self._waiting)

    def active_count(self) -> int:
        return len(self._active)

    def submit(self, req: Request) -> Request:
        with self._cv:
            if len(self._waiting) >= self.max_queue + max(0, self.max_batch - len(self._active)):
                self.metrics.requests["rejected"] += 1
                raise QueueFull(f"{len(self._waiting)} requests are waiting: try again later")
            self._waiting.append(req)
            self._cv.notify()
        return req

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------ worker
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self._waiting and not self._active:
                    self._cv.wait()
                if self._stop:
                    pending = list(self._waiting) + self._active
                    self._waiting.clear()
                    break
            try:
                if self.batch is None:
                    self._run_one()
                else:
                    self._admit(self.batch)
                    self._step(self.batch)
            except Exception as e:  # noqa: BLE001 - a bug must fail the requests in flight, not the server
                logger.exception("scheduler step failed")
                for r in list(self._active):
                    self._fail(r, e)
        for r in pending:
            self._finish_error(r, Cancelled("the server is shutting down"))

    def _make_job(self, req: Request) -> Job:
        """The request as a Job, set up by Model.plan exactly as `generate` sets it up."""
        m, s = self.model, req.settings
        plan = m.plan(s, datastore=self.datastore)
        drafter = plan.drafter
        if self.memory is not None and s.method_name in MEMORY_METHODS:
            drafter = with_memory(s.method_name, drafter, self.memory.index(req.namespace), self.datastore)

        def on_tokens(ids, req=req):
            self.metrics.add_tokens(len(ids))
            req.on_tokens(ids)

        return Job(
            req.ids,
            drafter=drafter,
            sampler=plan.sampler,
            max_new_tokens=s.max_new_tokens,
            budget=plan.budget,
            period=plan.period,
            tile=plan.tile,
            eos_ids=m.eos_ids,
            should_stop=plan.should_stop,
            on_tokens=on_tokens,
            prefill_embeds=req.prefill_embeds,
            capacity=self.batch.capacity if self.batch else 0,
            fill=plan.fill,
            single_rows=self.batch.single_rows if self.batch else 2,  # as Engine: what a lone token costs
        )

    def _admit(self, batch: BatchDriver[Request]) -> None:
        while True:
            with self._cv:
                if not self._waiting or len(self._active) >= self.max_batch:
                    return
                req = self._waiting.popleft()
            if req.cancelled:
                self._finish_error(req, Cancelled("cancelled before it started"))
                continue
            try:
                req.job = self._make_job(req)
            except Exception as e:  # noqa: BLE001 - a bad request fails alone
                self._finish_error(req, e)
                continue
            req.slot = batch.acquire(req)
            self._active.append(req)
            self.metrics.prompt_tokens += len(req.ids)

    def _step(self, batch: BatchDriver[Request]) -> None:
        for r in [r for r in self._active if r.cancelled]:
            self._release(r)
            self._finish_error(r, Cancelled("the client went away"))
        for r in [r for r in self._active if r.running.prefilling]:
            job = r.running
            logits, hidden = batch.prefill(r.slot, job.prefill_rows(), job.prompt_len, job.room)
            self._count_forward(1)
            job.after_prefill(partial(batch.commit, r.slot), logits, hidden)
            if job.done:
                self._complete(r)
        decoding = sorted((r for r in self._active if not r.running.prefilling), key=lambda r: r.slot)
        if not decoding:
            return
        planned: list[tuple[Request, Rows]] = []
        for r in decoding:
            try:
                planned.append((r, r.running.plan(batch.lengths[r.slot])))
            except Exception as e:  # noqa: BLE001 - a drafter failure fails its own request only
                self._fail(r, e)
        if not planned:
            return
        decoding = [r for r, _ in planned]
        rows: list[Rows | None] = [None] * batch.active
        for r, x in planned:  # slots are read after any release above moved them
            rows[r.slot] = x
        t0 = time.perf_counter()
        outs = batch.forward(0, rows)
        verify_s = time.perf_counter() - t0
        self._count_forward(sum(len(x.tokens) for x in rows if x is not None))
        self.metrics.shared_forwards += len(planned) > 1
        for r in decoding:
            logits, hidden = outs[r.slot]
            job = r.running
            before = (job.stats.drafted, job.stats.accepted)
            job.after_step(partial(batch.commit, r.slot), logits, hidden, verify_s, batch.last_run_s)
            name = r.settings.method_name
            self.metrics.drafted[name] = self.metrics.drafted.get(name, 0) + job.stats.drafted - before[0]
            self.metrics.accepted[name] = self.metrics.accepted.get(name, 0) + job.stats.accepted - before[1]
            self.metrics.steps[name] = self.metrics.steps.get(name, 0) + 1
        for r in decoding:
            if r.running.done:
                self._complete(r)

    def _count_forward(self, rows: int) -> None:
        self.metrics.forwards += 1
        self.metrics.forward_s += self.batch.last_run_s if self.batch is not None else 0.0
        self.metrics.batch_rows += rows

    def _release(self, r: Request) -> None:
        """Free a batched request's slot (the sequential path holds none)."""
        if self.batch is None:
            raise RuntimeError("only a batched request holds a slot")
        moved = self.batch.release(r.slot)
        if moved is not None:
            moved.slot = r.slot
        r.slot = -1
        self._active.remove(r)

    def _complete(self, r: Request) -> None:
        self._release(r)
        job = r.running
        if self.memory is not None:
            self.memory.add(r.namespace, job.tokens)
        self.metrics.requests["ok"] += 1
        assert job.reason is not None  # _complete is called for finished jobs only
        r.on_done(Result(job.new, job.prompt_len, job.reason, job.stats, r.settings.method_name, job.budget.tree, True))

    def _fail(self, r: Request, e: BaseException) -> None:
        if r in self._active:
            self._release(r)
        self._finish_error(r, e)

    def _finish_error(self, r: Request, e: BaseException) -> None:
        self.metrics.requests["cancelled" if isinstance(e, Cancelled) else "error"] += 1
        r.on_done(e)

    # ------------------------------------------------------------------ sequential fallback
    def _run_one(self) -> None:
        with self._cv:
            if not self._waiting:
                return
            req = self._waiting.popleft()
            self._active.append(req)
        try:
            if req.cancelled:
                raise Cancelled("cancelled before it started")
            s = req.settings
            name = s.method_name
            self.metrics.prompt_tokens += len(req.ids)

            def on_tokens(ids):
                if req.cancelled:
                    raise Cancelled("the client went away")
                self.metrics.add_tokens(len(ids))
                req.on_tokens(ids)

            if self.memory is not None and name in MEMORY_METHODS:
                # the drafter generate would build, over this namespace's memory
                own = self.model.plan(s, datastore=self.datastore).drafter
                s = replace(s, method=with_memory(name, own, self.memory.index(req.namespace), self.datastore))
            res = self.model.generate(
                req.ids, s, datastore=self.datastore, on_tokens=on_tokens, prefill_embeds=req.prefill_embeds
            )
            if self.memory is not None:
                self.memory.add(req.namespace, list(req.ids) + res.tokens)
            self.metrics.requests["ok"] += 1
            st = res.stats
            self.metrics.drafted[name] = self.metrics.drafted.get(name, 0) + st.drafted
            self.metrics.accepted[name] = self.metrics.accepted.get(name, 0) + st.accepted
            self.metrics.steps[name] = self.metrics.steps.get(name, 0) + st.steps
            req.on_done(Result(res.tokens, res.prompt_tokens, res.stop_reason, st, name, res.tree, False))
        except BaseException as e:  # noqa: BLE001 - reported to the request
            self._finish_error(req, e)
        finally:
            self._active.remove(req)
