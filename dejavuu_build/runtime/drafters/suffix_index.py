"""A token suffix index with incremental append, shared by every retrieval drafter.

Layout: the text is one flat list of token ids; documents are separated by ``SEP`` (-1) so no
match or continuation ever crosses a document boundary. Suffix start positions are kept
sorted by their first ``depth`` tokens (``depth`` is a power of two greater than the longest
supported match), in two runs:

* ``main``: a compact array built by numpy prefix doubling (what a datastore saves);
* ``dyn``: a small sorted Python list that appended suffixes are inserted into, folded back
  into ``main`` by a rebuild once it grows past a fraction of ``main``.

A suffix enters the sorted runs only once its first ``depth`` tokens exist ("settled"), so its
sort key never changes afterwards; the at most ``depth - 1`` unsettled positions at the end
are scanned directly. Truncated keys are what make appends cheap: an append settles one
position and costs one ``insort``. Because ``depth > max_len``, inside the range of a pattern
of length ``L <= max_len`` suffixes are also sorted by the token that follows the pattern,
so the positions that have a continuation (next token is not ``SEP`` or past the end) are a
contiguous tail of that range and can be found by bisection.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right, insort
from typing import Iterable, Sequence

import numpy as np

SEP = -1


def key_depth(max_len: int) -> int:
    """Smallest power of two strictly greater than ``max_len`` (see module docstring)."""
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    depth = 1
    while depth <= max_len:
        depth *= 2
    return depth


def sort_suffixes(tokens: np.ndarray, depth: int) -> np.ndarray:
    """Suffix start positions sorted by their first ``depth`` tokens (ties: by position).

    Prefix doubling: ``log2(depth)`` rounds of one argsort each. A position past the end of
    the text ranks below every token, like a shorter list below its extensions in Python.
    """
    n = len(tokens)
    if n == 0:
        return np.zeros(0, np.int64)
    _, inverse = np.unique(np.asarray(tokens, np.int64), return_inverse=True)
    rank = inverse.astype(np.int64).reshape(-1) + 1  # 0 = past the end
    h = 1
    while h < depth:
        nxt = np.zeros(n, np.int64)
        nxt[: n - h] = rank[h:]
        key = rank * (n + 1) + nxt
        order = np.argsort(key, kind="stable")
        skey = key[order]
        fresh = np.empty(n, bool)
        fresh[0] = True
        np.not_equal(skey[1:], skey[:-1], out=fresh[1:])
        rank = np.empty(n, np.int64)
        rank[order] = np.cumsum(fresh)
        h *= 2
        if rank[order[-1]] == n:  # all keys distinct already
            break
    return np.argsort(rank, kind="stable")


class SuffixIndex:
    """Find where a token pattern occurs and what followed it, over a growing token list."""

    def __init__(self, tokens: Iterable[int] = (), max_len: int = 32):
        self.max_len = int(max_len)
        self.depth = key_depth(self.max_len)
        self._t: list[int] = [int(x) for x in tokens]
        self._rebuild()

    @classmethod
    def from_arrays(cls, tokens: np.ndarray, sorted_positions: np.ndarray, max_len: int) -> "SuffixIndex":
        """Rehydrate a saved index (see :meth:`sorted_positions`) without re-sorting."""
        self = cls.__new__(cls)
        self.max_len = int(max_len)
        self.depth = key_depth(self.max_len)
        self._t = np.asarray(tokens).astype(np.int64).tolist()
        sa = np.asarray(sorted_positions, np.int64)
        if len(sa) != self._settled() or (len(sa) and (sa.min() < 0 or sa.max() >= self._settled())):
            raise ValueError("sorted positions do not match the tokens (wrong max_len or corrupt index)")
        self._main = array("q", sa.astype("=i8").tobytes())
        self._dyn = []
        return self

    # -- building -------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._t)

    @property
    def tokens(self) -> list[int]:
        """The indexed text (read-only by convention)."""
        return self._t

    def _settled(self) -> int:
        """Positions ``[0, settled)`` have all ``depth`` key tokens and live in the sorted runs."""
        return max(0, len(self._t) - self.depth + 1)

    def _rebuild(self) -> None:
        sa = sort_suffixes(np.asarray(self._t, np.int64), self.depth)
        sa = sa[sa < self._settled()]
        self._main = array("q", sa.astype("=i8").tobytes())
        self._dyn: list[int] = []

    def _rebuild_threshold(self) -> int:
        return 256 + len(self._main) // 4

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens (``SEP`` ends a document); amortised O(log n) per token."""
        t = self._t
        before = self._settled()
        t.extend(int(x) for x in tokens)
        after = self._settled()
        if after - before + len(self._dyn) > self._rebuild_threshold():
            self._rebuild()
            return
        depth = self.depth
        for p in range(before, after):
            insort(self._dyn, p, key=lambda q: t[q : q + depth])

    def append(self, token: int) -> None:
        self.extend((token,))

    def end_document(self) -> None:
        if self._t and self._t[-1] != SEP:
            self.extend((SEP,))

    def compact(self) -> None:
        """Fold appended suffixes into the main array (before saving)."""
        if self._dyn:
            self._rebuild()

    def sorted_positions(self) -> np.ndarray:
        """All settled positions in key order (compacts first)."""
        self.compact()
        return np.frombuffer(self._main, np.int64).copy()

    # -- queries --------------------------------------------------------------------------

    def _span(self, arr: Sequence[int], pattern: list[int], lo: int = 0, hi: int | None = None) -> tuple[int, int]:
        t = self._t
        n = len(pattern)

        def key(p):
            return t[p : p + n]

        lo = bisect_left(arr, pattern, lo, hi, key=key)
        return lo, bisect_right(arr, pattern, lo, hi, key=key)

    def _check(self, pattern: Sequence[int]) -> list[int]:
        pat = [int(x) for x in pattern]
        if not 1 <= len(pat) <= self.max_len:
            raise ValueError(f"pattern length {len(pat)} outside 1..{self.max_len}")
        return pat

    def find(self, pattern: Sequence[int]) -> list[int]:
        """Every start position of ``pattern`` in the text, ascending."""
        pat = self._check(pattern)
        out: list[int] = []
        for arr in (self._main, self._dyn):
            lo, hi = self._span(arr, pat)
            out.extend(arr[lo:hi])
        out.extend(self._tail_hits(pat, continued=False))
        return sorted(out)

    def count(self, pattern: Sequence[int]) -> int:
        return len(self.find(pattern))

    def _continued_spans(self, pat: list[int]):
        """Per sorted run, the index range of occurrences of ``pat`` followed by a real token."""
        nxt = pat + [0]
        t, n = self._t, len(nxt)
        for arr in (self._main, self._dyn):
            lo, hi = self._span(arr, pat)
            if lo < hi:
                lo = bisect_left(arr, nxt, lo, hi, key=lambda p: t[p : p + n])
            yield arr, lo, hi

    def _tail_hits(self, pat: list[int], continued: bool) -> list[int]:
        """Occurrences among the unsettled positions (``list.index`` scans in C)."""
        t, n = self._t, len(pat)
        stop = len(t) - n + (0 if continued else 1)
        p, first, out = self._settled(), pat[0], []
        while p < stop:
            try:
                p = t.index(first, p, stop)
            except ValueError:
                break
            if t[p : p + n] == pat and (not continued or t[p + n] >= 0):
                out.append(p)
            p += 1
        return out

    def has_continuation(self, pattern: Sequence[int]) -> bool:
        """Whether ``pattern`` occurs somewhere that is followed by at least one token."""
        pat = self._check(pattern)
        return any(lo < hi for _, lo, hi in self._continued_spans(pat)) or bool(self._tail_hits(pat, continued=True))

    def longest_match(self, query: Sequence[int], min_len: int = 1, max_len: int | None = None) -> int:
        """Largest ``L`` in ``[min_len, max_len]`` such that ``query[-L:]`` occurs with a continuation; 0 if none.

        Binary search is valid because a match of length ``L`` implies one of ``L - 1``.
        """
        cap = min(self.max_len, max_len or self.max_len, len(query))
        q = [int(x) for x in query[len(query) - cap :]] if cap > 0 else []
        for i in range(len(q) - 1, -1, -1):  # a pattern never contains a separator
            if q[i] < 0:
                q = q[i + 1 :]
                break
        lo, hi = max(1, min_len), len(q)
        if lo > hi or not self.has_continuation(q[-lo:]):
            return 0
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.has_continuation(q[-mid:]):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def match_ends(self, pattern: Sequence[int], limit: int | None = None, max_scan: int = 1024) -> list[int]:
        """Continuation starts (``p + len(pattern)``) of occurrences with a continuation.

        Latest first, up to ``limit``. When more than ``max_scan`` occurrences exist (a common
        pattern in a big datastore), ``limit`` of them are instead stride-sampled across the
        sorted range, which keeps the cost bounded and the continuation frequencies
        representative; the unsettled newest positions are always included.
        """
        pat = self._check(pattern)
        spans = list(self._continued_spans(pat))
        total = sum(hi - lo for _, lo, hi in spans)
        want = limit if limit is not None and total > max_scan else total
        step = max(1, -(-total // max(want, 1)))
        starts: list[int] = []
        for arr, lo, hi in spans:
            starts.extend(arr[lo:hi:step])
        starts.extend(self._tail_hits(pat, continued=True))
        starts.sort(reverse=True)
        n = len(pat)
        return [p + n for p in starts[:limit]]

    def matches(self, query: Sequence[int], min_len: int, max_len: int, limit: int) -> list[tuple[int, int]]:
        """Up to ``limit`` ``(match_len, continuation_start)`` pairs: longest matches first, latest first
        within a length, then shorter matches at positions not already listed."""
        best = self.longest_match(query, min_len, max_len)
        out: list[tuple[int, int]] = []
        seen: set[int] = set()
        q = [int(x) for x in query[len(query) - best :]] if best else []
        for length in range(best, max(1, min_len) - 1, -1):
            for e in self.match_ends(q[len(q) - length :], limit=limit):
                if e not in seen:
                    seen.add(e)
                    out.append((length, e))
                    if len(out) >= limit:
                        return out
        return out

    def continuation(self, start: int, length: int, periodic: bool = False) -> list[int]:
        """Up to ``length`` tokens from ``start``, stopping at a document end.

        ``periodic``: when the copy runs into the end of a live text (the current request), keep
        copying with period ``len - start``: the text at the end matched the text before
        ``start``, so what follows the end is predicted to repeat what followed ``start``.
        """
        t = self._t
        out = t[start : start + length]
        try:
            return out[: out.index(SEP)]
        except ValueError:
            pass
        end = len(t)
        if periodic and len(out) < length and start < end:
            period = end - start
            out = [t[start + k % period] for k in range(length)]
        return out
