"""The speculation gate, driven by fake step timings: it learns per batch size whether drafts pay, keeps checking the
choice it dropped, compares only neighbouring pure decode steps, and an explicit limit replaces it."""

from __future__ import annotations

from pagedllm.core.speculation_gate import EXPLORE_EVERY, MIN_PAIRS, SpeculationGate


def run(gate: SpeculationGate, running: int, with_drafts: float, without: float, steps: int,
        pure_decode: bool = True) -> list[bool]:
    """`steps` steps at `running` sequences, each giving `with_drafts` or `without` tokens in one second."""
    choices = []
    for _ in range(steps):
        drafts = gate.choose(running)
        gate.record(int(with_drafts if drafts else without), 1.0, pure_decode)
        choices.append(drafts)
    return choices


def test_drafts_kept_where_they_pay_and_the_other_choice_checked_one_step_in_explore_every():
    gate = SpeculationGate()
    choices = run(gate, 3, with_drafts=150, without=100, steps=20 * EXPLORE_EVERY)
    settled = choices[4 * MIN_PAIRS:]
    assert abs(settled.count(False) - len(settled) / EXPLORE_EVERY) <= 1  # one visit of one step per EXPLORE_EVERY
    assert all(a or b for a, b in zip(settled, settled[1:]))
    [row] = gate.table()
    assert row["running"] == "2-3" and row["drafts"] is True and row["drafts_gain"] == 1.5


def test_drafts_dropped_where_they_cost_and_checked_two_steps_at_a_time():
    gate = SpeculationGate()
    choices = run(gate, 100, with_drafts=80, without=100, steps=20 * EXPLORE_EVERY)
    settled = choices[4 * MIN_PAIRS:]
    assert 0 < settled.count(True) <= 2 * (len(settled) // EXPLORE_EVERY + 1)
    visits = [i for i, (a, b) in enumerate(zip(settled, settled[1:])) if a and not b]
    assert visits and all(settled[i - 1] for i in visits)  # each visit is two steps with drafts
    [row] = gate.table()
    assert row["drafts"] is False and row["drafts_gain"] == 0.8


def test_a_few_steps_that_accept_every_draft_outweigh_many_that_accept_none():
    """Steps with drafts cost 1.2x; three in four accept nothing, one accepts all: 1.46x the tokens/s on average,
    though the typical (median) step with drafts is 0.83x."""
    gate = SpeculationGate()
    with_steps = 0
    for _ in range(200):
        drafts = gate.choose(10)
        if drafts:
            with_steps += 1
            gate.record(40 if with_steps % 4 == 0 else 10, 1.2, True)
        else:
            gate.record(10, 1.0, True)
    [row] = gate.table()
    assert row["drafts"] is True and 1.2 < row["drafts_gain"] < 1.8


def test_drafts_stay_on_through_a_small_loss_and_are_visited_more_often_past_it():
    gate = SpeculationGate()
    choices = run(gate, 40, with_drafts=97, without=100, steps=10 * EXPLORE_EVERY)
    assert gate.table()[0]["drafts"] is True and choices[-EXPLORE_EVERY:].count(False) == 1
    gate = SpeculationGate()
    choices = run(gate, 40, with_drafts=90, without=100, steps=10 * EXPLORE_EVERY)[4 * MIN_PAIRS:]
    assert gate.table()[0]["drafts"] is False
    assert abs(choices.count(True) - 2 * len(choices) / (EXPLORE_EVERY // 2)) <= 2  # two steps every 16


def test_each_batch_size_bucket_learns_alone():
    gate = SpeculationGate()
    run(gate, 5, with_drafts=200, without=100, steps=50)
    run(gate, 200, with_drafts=90, without=100, steps=50)
    choices = {r["running"]: r["drafts"] for r in gate.table()}
    assert choices == {"4-7": True, "128-255": False}
    assert gate.choose(6) and not gate.choose(130)


def test_the_choice_follows_when_drafts_stop_paying():
    gate = SpeculationGate()
    run(gate, 20, with_drafts=150, without=100, steps=100)
    later = run(gate, 20, with_drafts=70, without=100, steps=12 * EXPLORE_EVERY)
    assert gate.table()[0]["drafts"] is False
    assert later[-4 * EXPLORE_EVERY:].count(True) <= 2 * 4  # the median turned within a few visits


def test_steps_with_prompt_chunks_break_the_comparisons():
    gate = SpeculationGate()
    run(gate, 8, with_drafts=150, without=100, steps=40, pure_decode=False)
    assert gate.table()[0]["comparisons"] == 0  # decided, but nothing compared


def test_the_first_step_with_drafts_after_several_without_is_not_compared():
    """It also catches every lookup up on the tokens since, a cost later steps with drafts do not pay."""
    gate = SpeculationGate()
    assert gate.choose(4)
    gate.record(10, 1.0, True)  # with drafts
    assert not gate.choose(4)
    gate.record(10, 1.0, True)  # without: compared, 1.0
    gate.record(0, 1.0, False)  # a step the gate did not decide (requests waited)
    assert gate.choose(4)
    gate.record(1, 1.0, True)  # two steps without before it: not compared, however slow
    assert gate.choose(4)
    gate.record(20, 1.0, True)  # the next one is
    assert not gate.choose(4)
    gate.record(10, 1.0, True)
    assert gate.table()[0]["comparisons"] == 2 and gate.table()[0]["drafts_gain"] == 1.5


def test_an_explicit_limit_replaces_the_measurement():
    gate = SpeculationGate(limit=16)
    assert gate.choose(16) and not gate.choose(17)
    gate.record(10, 1.0, True)
    assert gate.table() == []


def alternate(gate: SpeculationGate, running: int, rows_with: int, seconds_with: float, pairs: int) -> None:
    """Pairs of neighbouring steps at `running` sequences: without drafts `running` rows in 1 s, with them
    `rows_with` rows in `seconds_with` (and twice the tokens, so drafts pay and the gate keeps alternating early)."""
    for _ in range(2 * pairs):
        drafts = gate.choose(running)
        gate.record(2 * running if drafts else running, seconds_with if drafts else 1.0, True,
                    rows_with if drafts else running)


def test_the_row_cost_sets_how_much_any_sequence_may_propose():
    """Where extra rows cost nothing (a step reading the weights) every sequence may propose all it may; where a row
    costs what a token does, only what its window earned; in between, a share of it."""
    gate = SpeculationGate()
    assert gate.proposal_floor(1, 4) == 0  # nothing measured: the windows alone
    alternate(gate, 1, rows_with=5, seconds_with=1.0, pairs=MIN_PAIRS)  # 5 rows in the time of 1
    alternate(gate, 64, rows_with=128, seconds_with=2.0, pairs=MIN_PAIRS)  # twice the rows, twice the time
    alternate(gate, 16, rows_with=32, seconds_with=1.5, pairs=MIN_PAIRS)  # half a token's time a row
    assert [gate.proposal_floor(n, 4) for n in (1, 64, 16)] == [4, 0, 2]
    assert {r["running"]: r["row_cost"] for r in gate.table()} == {"1-1": 0.0, "16-31": 0.5, "64-127": 1.0}
    alternate(gate, 100, rows_with=100, seconds_with=1.0, pairs=MIN_PAIRS)  # no step had extra rows: unmeasured
    assert gate.proposal_floor(100, 4) == 0
    assert SpeculationGate(limit=16).proposal_floor(1, 4) == 4  # an explicit limit: every proposal as long as it may
