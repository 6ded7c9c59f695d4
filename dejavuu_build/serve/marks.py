"""How a stream's text was produced: which characters came from draft tokens the verify accepted,
which from the model's own picks, and each verify step's drafted/accepted counts.

The scheduler hands each step's committed ids to the API as a ``runtime.job.StepTokens`` (a list
of ids whose first ``accepted`` are accepted draft tokens). ``MarkedStream`` decodes them one token
at a time (so every character is traced to its token) and sends exactly the text ``TextStream``
would send (the same incremental decoding, the same hold-back and cut at stop strings), split into
spans by source. The spans ride in the SSE chunk's ``dejavuu`` extension field (docs/serving.md);
standard clients ignore it.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Sequence

from ..runtime.stops import StopStream
from ..runtime.tokenizer import IncrementalDecoder

if TYPE_CHECKING:
    from ..runtime.tokenizer import TextTokenizer

DRAFT, MODEL = "draft", "model"


class MarkedStream:
    """Steps' ids in; out, the text a stream may send as ``[{"text", "source"}]`` spans (``source``
    ``"draft"``: from accepted draft tokens, ``"model"``: the model's own picks), whose texts join to
    what ``TextStream`` sends for the same ids. ``take_steps`` gives the verify steps seen since its
    last call."""

    def __init__(self, tokenizer: TextTokenizer, stops: Sequence[str]):
        self.dec = IncrementalDecoder(tokenizer)
        self.text = StopStream(stops)
        self.pending: deque[list] = deque()  # [text, source] decoded but not yet sent
        self.steps: list[dict] = []

    def push(self, ids: Sequence[int]) -> list[dict]:
        accepted = int(getattr(ids, "accepted", 0))
        if getattr(ids, "step", False):
            self.steps.append({"tokens": len(ids), "drafted": int(getattr(ids, "drafted", 0)), "accepted": accepted})
        sent = 0
        for i, t in enumerate(ids):
            piece = self.dec.push([t])
            if piece:
                self.pending.append([piece, DRAFT if i < accepted else MODEL])
                sent += len(self.text.push(piece))
        return self._take(sent)

    def finish(self) -> list[dict]:
        piece = self.dec.flush()
        if piece:
            self.pending.append([piece, MODEL])
        return self._take(len(self.text.push(piece, final=True)))

    def take_steps(self) -> list[dict]:
        steps, self.steps = self.steps, []
        return steps

    def _take(self, n: int) -> list[dict]:
        """The next ``n`` characters of the pending text as spans (StopStream sends a prefix of what
        it was given, so what it sent is the front of ``pending``)."""
        spans: list[dict] = []
        while n > 0:
            seg = self.pending[0]
            part = seg[0][:n]
            if len(part) == len(seg[0]):
                self.pending.popleft()
            else:
                seg[0] = seg[0][n:]
            n -= len(part)
            if spans and spans[-1]["source"] == seg[1]:
                spans[-1]["text"] += part
            else:
                spans.append({"text": part, "source": seg[1]})
        return spans
