"""The offline replay (bench.replay): drafters against recorded greedy answers, step by step."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from dejavuu_build.bench import BenchConfig
from dejavuu_build.bench.replay import Recording, Turn, record, replay, replay_turn
from dejavuu_build.runtime.drafters import Draft, Drafter, make_drafter

PROMPT = [1, 2, 3, 4, 5]
ANSWER = [10, 11, 12, 13, 14, 15, 16, 17, 18]  # 8 tokens after the prefill's
COST = {1: 1.0, 2: 1.5, 3: 1.75, 4: 2.0}


def turn(answer=ANSWER, category="qa", qid="1") -> Turn:
    return Turn(qid, category, 1, list(PROMPT), list(answer), [[t, t + 1] for t in answer], "max_new_tokens")


class Knows(Drafter):
    """Drafts the next ``k`` tokens of the answer, with the ``wrong``-th (1-based) one changed."""

    name = "knows"

    def __init__(self, k: int, wrong: int = 0):
        self.k, self.wrong = k, wrong
        self.seen: list[list[int]] = []

    def propose(self, context, budget):
        at = len(context) - len(PROMPT)
        toks = ANSWER[at : at + min(self.k, budget.max_depth)]
        if self.wrong and len(toks) >= self.wrong:
            toks[self.wrong - 1] = 99
        return Draft.chain(toks)

    def feedback(self, fb):
        self.seen.append(list(fb.committed))


def test_a_drafter_that_knows_the_answer_gets_exactly_its_tokens_per_step():
    d = Knows(3)
    r = replay_turn(d, turn(), COST, fill=False)
    # 3 accepted + the bonus token per step: 8 decode tokens in 2 steps of 4 rows each
    assert (r.steps, r.accepted, r.drafted) == (2, 6, 6)
    assert r.cost == pytest.approx(4.0)
    assert d.seen == [[10], [11, 12, 13, 14], [15, 16, 17, 18]]  # the prefill's token, then each step's


def test_a_wrong_token_ends_the_accepted_prefix():
    r = replay_turn(Knows(3, wrong=2), turn(), COST, fill=False)
    assert (r.steps, r.accepted) == (4, 4)  # 1 accepted + bonus per step: 2 tokens per step
    assert r.cost == pytest.approx(3 * 2.0 + 1.5)  # the last step has room for one drafted token
    plain = replay_turn(Drafter(), turn(), COST, fill=False)
    assert (plain.steps, plain.accepted, plain.cost) == (8, 0, 8.0)


def test_the_budget_stops_drafts_at_the_answer_end():
    r = replay_turn(Knows(8), turn(), COST, fill=False)
    assert r.steps == 1 and r.accepted == 7  # 7 drafted + the bonus token = the 8 decode tokens


def test_replay_reports_tokens_per_step_speedup_and_share_per_category():
    rec = Recording("m", None, 8, {}, [turn(), turn(ANSWER, "rag", "2")])
    rows = replay(rec, ["knows"], cost=COST, step_ms=10.0, fill=False, make=lambda m, c: Knows(3))
    by = {(r.category, r.method): r for r in rows}
    qa = by["qa", "knows"]
    assert qa.tokens_per_step == pytest.approx(4.0)
    assert qa.speedup_no_draft == pytest.approx(8 / 4.0)
    assert qa.acceptance == pytest.approx(1.0)
    # the oracle copies only what the context holds: this answer never repeats, so it drafts nothing
    assert qa.oracle_tokens_per_step == pytest.approx(1.0) and qa.share is None
    assert by["overall", "knows"].tokens_per_step == pytest.approx(4.0)


def test_replay_of_a_real_method_reproduces_the_answer_and_copies_repeats():
    rep = [7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8, 9, 7]
    t = Turn("1", "qa", 1, [7, 8, 9], rep, [[x] for x in rep], "max_new_tokens")
    r = replay_turn(make_drafter("pld"), t, COST, fill=False)
    assert r.steps < len(rep) - 1 and r.accepted == len(rep) - 1 - r.steps
    rec = Recording("m", None, 16, {}, [t])
    row = {x.method: x for x in replay(rec, ["baseline", "pld"], cost=COST, make=lambda m, c: make_drafter(m))}
    assert row["baseline"].tokens_per_step == pytest.approx(1.0)  # plain decoding: no draft, no fill
    assert row["pld"].tokens_per_step > 2 and row["pld"].oracle_tokens_per_step > 2


def test_recording_round_trips_and_the_cli_replays_it(tmp_path):
    from dejavuu_build.cli import main

    path = Recording("m", None, 8, {1: 0.01, 2: 0.012}, [turn()], {"note": "x"}).save(tmp_path / "rec.json")
    back = Recording.load(path)
    assert back.turns[0] == turn() and back.row_costs_s == {1: 0.01, 2: 0.012}
    r = CliRunner().invoke(
        main,
        [
            "bench",
            "--model",
            "m",
            "--replay",
            str(path),
            "--methods",
            "pld",
            "--categories",
            "qa",
            "--out",
            str(tmp_path),
        ],
    )
    assert r.exit_code == 0, r.output
    assert "pld" in r.output and (tmp_path / "replay.csv").is_file()
    assert json.loads((tmp_path / "replay.json").read_text())["recording"] == str(path)
    # a recording of other prompts than the run asks for is refused, not replayed as if it were them
    r = CliRunner().invoke(main, ["bench", "--model", "m", "--replay", str(path), "--methods", "pld", "--skip", "10"])
    assert r.exit_code == 2 and "--skip 0" in r.output, r.output


def test_record_keeps_plain_decoding_answers_and_their_top_k(tiny_llama, tmp_path):
    data = tmp_path / "q.jsonl"
    data.write_text(
        json.dumps({"question_id": 1, "category": "qa", "turns": ["The cat sat on the mat. The cat"]}) + "\n"
    )
    cfg = BenchConfig(
        model=str(tiny_llama), data=str(data), categories=("qa",), per_category=1, max_new_tokens=12, threads=1
    )
    rec = record(cfg, tmp_path / "rec.json")
    assert rec.meta["skip"] == 0
    (t,) = rec.turns
    assert len(t.answer) == len(t.topk) and [row[0] for row in t.topk] == t.answer
    from dejavuu_build.runtime import load
    from dejavuu_build.runtime.settings import DecodeSettings

    plain = load(str(tiny_llama), threads=1).generate(
        [{"role": "user", "content": "The cat sat on the mat. The cat"}], DecodeSettings(max_new_tokens=12)
    )
    assert t.answer == list(plain.tokens)
    row = {x.method: x for x in replay(Recording.load(tmp_path / "rec.json"), ["baseline", "suffix_decoding"])}
    assert row["suffix_decoding"].tokens_per_step >= 1.0
