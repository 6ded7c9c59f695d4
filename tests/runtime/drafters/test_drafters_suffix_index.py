"""SuffixIndex against brute force: occurrences, longest match, continuations, appends."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dejavuu_build.runtime.drafters.suffix_index import SEP, SuffixIndex, sort_suffixes

# Small alphabets make repeats (and long matches) common; SEP splits documents.
tokens_st = st.lists(st.integers(0, 3) | st.just(SEP), max_size=120)
pattern_st = st.lists(st.integers(0, 3), min_size=1, max_size=7)
MAX_LEN = 7


def brute_find(t, pat):
    n = len(pat)
    return [p for p in range(len(t) - n + 1) if t[p : p + n] == pat]


def brute_ends(t, pat):
    n = len(pat)
    return sorted(p + n for p in brute_find(t, pat) if p + n < len(t) and t[p + n] >= 0)


def brute_longest(t, query, min_len, max_len):
    best = 0
    for length in range(max(1, min_len), min(max_len, len(query)) + 1):
        pat = query[len(query) - length :]
        if SEP not in pat and brute_ends(t, pat):
            best = length
    return best


@settings(max_examples=150, deadline=None)
@given(tokens_st, pattern_st)
def test_find_and_match_ends_equal_brute_force(tokens, pattern):
    idx = SuffixIndex(tokens, max_len=MAX_LEN)
    assert idx.find(pattern) == brute_find(tokens, pattern)
    assert idx.count(pattern) == len(brute_find(tokens, pattern))
    ends = idx.match_ends(pattern)
    assert sorted(ends) == brute_ends(tokens, pattern)
    assert ends == sorted(ends, reverse=True)  # latest first
    assert idx.has_continuation(pattern) == bool(ends)


@settings(max_examples=150, deadline=None)
@given(tokens_st, st.lists(st.integers(0, 3), max_size=12), st.integers(1, 3), st.integers(1, MAX_LEN))
def test_longest_match_equals_brute_force(tokens, query, min_len, max_len):
    idx = SuffixIndex(tokens, max_len=MAX_LEN)
    assert idx.longest_match(query, min_len, max_len) == brute_longest(tokens, query, min_len, max_len)


@settings(max_examples=100, deadline=None)
@given(tokens_st, st.lists(st.integers(0, 3), min_size=1, max_size=12), st.integers(1, 6))
def test_matches_are_longest_first_and_distinct(tokens, query, limit):
    idx = SuffixIndex(tokens, max_len=MAX_LEN)
    got = idx.matches(query, 1, MAX_LEN, limit)
    assert len(got) <= limit
    assert len({e for _, e in got}) == len(got)
    assert [length for length, _ in got] == sorted((length for length, _ in got), reverse=True)
    for length, e in got:
        assert tokens[e - length : e] == query[len(query) - length :] and tokens[e] >= 0
    if got:
        assert got[0][0] == brute_longest(tokens, query, 1, MAX_LEN)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3) | st.just(SEP), max_size=30), max_size=12), pattern_st)
def test_incremental_append_equals_rebuild(chunks, pattern):
    grown = SuffixIndex(max_len=MAX_LEN)
    for chunk in chunks:
        grown.extend(chunk)
    flat = [t for chunk in chunks for t in chunk]
    built = SuffixIndex(flat, max_len=MAX_LEN)
    assert grown.tokens == flat
    assert grown.find(pattern) == built.find(pattern)
    assert grown.match_ends(pattern) == built.match_ends(pattern)
    assert grown.longest_match(flat[-MAX_LEN:] + pattern, 1) == built.longest_match(flat[-MAX_LEN:] + pattern, 1)
    # the sorted runs hold every settled position in key order
    order = grown.sorted_positions()
    depth = grown.depth
    keys = [flat[p : p + depth] for p in order]
    assert keys == sorted(keys) and sorted(order.tolist()) == list(range(max(0, len(flat) - depth + 1)))


def test_many_appends_trigger_rebuild_and_stay_correct():
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 5, 3000).tolist()
    idx = SuffixIndex(max_len=8)
    for t in toks:
        idx.append(t)
    for pat in ([1, 2], [0, 0, 0], [4, 3, 2, 1]):
        assert idx.find(pat) == brute_find(toks, pat)


def test_sort_suffixes_orders_by_truncated_keys():
    rng = np.random.default_rng(1)
    toks = rng.integers(-1, 3, 500)
    sa = sort_suffixes(toks, 8)
    keys = [toks[p : p + 8].tolist() for p in sa]
    assert keys == sorted(keys)


def test_continuation_stops_at_document_end_and_extends_periodically():
    idx = SuffixIndex([5, 6, 7, SEP, 1, 2, 3, 1, 2], max_len=4)
    assert idx.continuation(1, 5) == [6, 7]
    assert idx.continuation(6, 5) == [3, 1, 2]
    # the tail "1 2" matched at 4..5, so after the end comes "3 1 2" again
    assert idx.continuation(6, 5, periodic=True) == [3, 1, 2, 3, 1]
    assert idx.match_ends([1, 2]) == [6]


def test_pattern_length_is_checked():
    idx = SuffixIndex([1, 2, 3], max_len=2)
    for bad in ([], [1, 2, 3]):
        try:
            idx.find(bad)
        except ValueError:
            continue
        raise AssertionError(f"pattern {bad} accepted")


def test_common_patterns_are_sampled_not_scanned():
    toks = [1, 2, 3] * 2000
    idx = SuffixIndex(toks, max_len=4)
    ends = idx.match_ends([1, 2], limit=16, max_scan=64)
    assert 0 < len(ends) <= 16 and len(set(ends)) == len(ends)
    assert all(toks[e - 2 : e] == [1, 2] for e in ends)
    assert len(idx.match_ends([1, 2], limit=16, max_scan=10**6)) == 16
    assert idx.match_ends([1, 2], limit=3, max_scan=10**6) == [5999, 5996, 5993]  # latest first
