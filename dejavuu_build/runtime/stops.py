"""Stop strings: generated text ends just before the first of the caller's stop strings.

One owner for every place that needs them. ``stop_fn`` tells the engine after each step which
prefix of the generated ids ends in a stop string, so decoding stops there (Model.generate, the
server's scheduler); ``cut`` trims a whole answer; ``StopStream`` (text pieces) and ``TextStream``
(token ids) give a stream the text it may send: the last characters are held back while they could
still begin a stop string, so a stop string split between two steps is never sent in part.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from ..errors import GenerationError
from .tokenizer import IncrementalDecoder

if TYPE_CHECKING:
    from .job import StopFn
    from .tokenizer import TextTokenizer


def as_list(stop: str | Sequence[str] | None) -> list[str]:
    """``stop`` as a list: one string, several or none (GenerationError for anything else, such as
    a number)."""
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, (bytes, dict)) or not hasattr(stop, "__iter__"):
        raise GenerationError(f"stop must be a string or a list of strings, got {str(repr(stop))[:40]}")
    return list(stop)


def find_stop(text: str, stops: Sequence[str]) -> int:
    """Where the first stop string in ``text`` begins; -1 where there is none."""
    return min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)


def cut(text: str, stops: Sequence[str]) -> str:
    """``text`` up to the first stop string in it."""
    i = find_stop(text, stops)
    return text[:i] if i >= 0 else text


def stop_fn(tokenizer: TextTokenizer | None, stops: Sequence[str]) -> StopFn:
    """``should_stop(ids)``: the length of the first prefix of ``ids`` whose text holds a stop
    string, else None. The engine calls it with the generated ids after every step, each call
    extending the last: it decodes the new ids only (IncrementalDecoder) and searches the new text
    plus the last few characters before it."""
    if tokenizer is None:
        raise GenerationError("stop strings are matched in the text, and this model has no tokenizer: leave them out")
    dec = IncrementalDecoder(tokenizer)
    keep = max(len(s) for s in stops) - 1
    seen, tail = 0, ""

    def should_stop(new: list[int]) -> int | None:
        nonlocal seen, tail
        for i in range(seen, len(new)):
            piece = dec.push([new[i]])
            if piece:
                window = tail + piece
                if any(s in window for s in stops):
                    return i + 1
                tail = window[len(window) - keep :] if keep else ""
        seen = len(new)
        return None

    return should_stop


class StopStream:
    """Text pieces in, the text a stream may send out: everything before the first stop string,
    less the last ``len(longest stop) - 1`` characters while they could still begin one;
    ``finish`` gives what is held back at the end."""

    def __init__(self, stops: Sequence[str]):
        self.stops = list(stops)
        self.hold = max((len(s) for s in self.stops if isinstance(s, str)), default=1) - 1
        self.pending = ""
        self.stopped = False

    def push(self, piece: str, final: bool = False) -> str:
        if self.stopped:
            return ""
        self.pending += piece
        i = find_stop(self.pending, self.stops)
        if i >= 0:
            self.pending, self.stopped = self.pending[:i], True
        ready = len(self.pending) if (self.stopped or final) else len(self.pending) - self.hold
        if ready <= 0:
            return ""
        out, self.pending = self.pending[:ready], self.pending[ready:]
        return out

    def finish(self) -> str:
        return self.push("", final=True)


class TextStream:
    """Token ids in (a step's committed ids at a time), the text a stream may send out: decoded
    incrementally, then held back and cut as StopStream does."""

    def __init__(self, tokenizer: TextTokenizer, stops: Sequence[str]):
        self.dec = IncrementalDecoder(tokenizer)
        self.text = StopStream(stops)

    def push(self, ids: Sequence[int]) -> str:
        return self.text.push(self.dec.push(ids))

    def finish(self) -> str:
        return self.text.push(self.dec.flush(), final=True)
