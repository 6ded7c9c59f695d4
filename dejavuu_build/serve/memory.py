"""Drafter memory shared across requests: a suffix index over earlier prompts and responses.

A one-shot drafter forgets everything when its request ends; a server sees the same templates,
quoted turns and answers again and again (SuffixDecoding's global tree). ``Memory`` keeps one
``SuffixIndex`` per namespace (a deployment key, so tenants never draft from each other's
text), bounded in tokens: past the bound the oldest documents are dropped (the newest half is
kept, cut at a document start), and past ``max_namespaces`` the least recently used namespace
goes. Drafting from memory never changes the output (verification decides every token); it
only changes how many tokens a step confirms.

Only the scheduler's worker thread touches a Memory (reads while drafting, writes when a
request finishes), so it needs no lock.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from .. import schema as S
from ..runtime.drafters.base import Drafter
from ..runtime.drafters.suffix import AdaptiveSam, SuffixDecoding
from ..runtime.drafters.suffix_index import SEP, SuffixIndex

MEMORY_METHODS = ("suffix_decoding", "asam", "auto")


class Memory:
    def __init__(self, max_tokens: int = S.DEFAULT_MEMORY_TOKENS, max_namespaces: int = 64, max_match: int = 32):
        if max_tokens < 1 or max_namespaces < 1:
            raise ValueError("memory bounds must be >= 1")
        self.max_tokens, self.max_namespaces, self.max_match = max_tokens, max_namespaces, max_match
        self._spaces: OrderedDict[str, SuffixIndex] = OrderedDict()
        self.evicted_tokens = 0

    def index(self, namespace: str) -> SuffixIndex:
        idx = self._spaces.get(namespace)
        if idx is None:
            idx = self._spaces[namespace] = SuffixIndex(max_len=self.max_match)
            while len(self._spaces) > self.max_namespaces:
                _, old = self._spaces.popitem(last=False)
                self.evicted_tokens += len(old)
        self._spaces.move_to_end(namespace)
        return idx

    def add(self, namespace: str, tokens: Sequence[int]) -> None:
        """Remember one finished request (prompt + response) as a document."""
        idx = self.index(namespace)
        idx.extend(int(t) for t in tokens)
        idx.end_document()
        if len(idx) > self.max_tokens:
            toks = idx.tokens
            start = len(toks) - self.max_tokens // 2
            while start < len(toks) and toks[start - 1] != SEP:
                start += 1
            self.evicted_tokens += start
            self._spaces[namespace] = SuffixIndex(toks[start:], max_len=self.max_match)

    def tokens(self, namespace: str | None = None) -> int:
        if namespace is not None:
            return len(self._spaces[namespace]) if namespace in self._spaces else 0
        return sum(len(i) for i in self._spaces.values())

    @property
    def namespaces(self) -> list[str]:
        return list(self._spaces)


class MemorySuffixDecoding(SuffixDecoding):
    """suffix_decoding whose global history is the shared memory (read-only while the request
    runs) plus this request's own live index; the longer match wins, the live one on ties."""

    def __init__(self, memory: SuffixIndex, **kwargs):
        super().__init__(**kwargs)
        self.memory = memory

    def _sources(self):
        return [(self.memory, False), (self._global, True)]


class MemoryAsam(AdaptiveSam):
    """asam with the shared memory as a second static source beside its datastore."""

    def __init__(self, memory: SuffixIndex, datastore=None, **kwargs):
        super().__init__(datastore, **kwargs)
        self.memory = memory

    def _sources(self):
        return [(self.datastore.index, False), (self.memory, False), (self._live, True)]


def with_memory(method: str, drafter: Drafter, index: SuffixIndex, datastore=None) -> Drafter:
    """The drafter for ``method`` reading ``index``; methods that keep no history are returned as is."""
    if method == "suffix_decoding":
        return MemorySuffixDecoding(index)
    if method == "asam":
        return MemoryAsam(index, datastore)
    if method == "auto":
        from ..runtime.drafters.auto import Auto

        if isinstance(drafter, Auto) and "suffix_decoding" in drafter.member_names:
            i = drafter.member_names.index("suffix_decoding")
            drafter.members[i] = MemorySuffixDecoding(index)
        return drafter
    return drafter
