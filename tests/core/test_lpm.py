"""The longest-prefix-match policy without a model: it scores waiting requests as the prefix cache would match them,
admits in that order, loses nothing, keeps the block invariants, and no request is overtaken by more than
max_skips later arrivals."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_scheduler import Sim
from test_scheduling_policies import RandomWorkload, policy_sim, request

from pagedllm.config import SchedulerConfig
from pagedllm.core.baselines import make_scheduler
from pagedllm.core.lpm import LongestPrefixQueue, LongestPrefixScheduler, Waiting
from pagedllm.core.sequence import Sequence, SequenceGroup
from pagedllm.outputs import RequestMetrics
from pagedllm.sampling_params import SamplingParams


def test_make_scheduler_picks_lpm():
    sched = make_scheduler(SchedulerConfig(scheduling_policy="lpm"), 64)
    assert type(sched) is LongestPrefixScheduler and isinstance(sched.waiting, LongestPrefixQueue)


def prompt_request(rid: str, tokens: list[int], max_tokens: int, n: int = 1, arrival: float = 0.0) -> Sequence:
    return Sequence(rid, None, tokens, SamplingParams(max_tokens=max_tokens, n=n), RequestMetrics(arrival),
                    max_tokens=max_tokens)


def lpm_sim(num_blocks: int, block_size: int, max_num_seqs: int, budget: int, window: int = 64,
            max_skips: int = 16) -> Sim:
    sim = policy_sim(LongestPrefixScheduler, num_blocks, block_size, max_num_seqs, budget)
    sim.sched.waiting = LongestPrefixQueue(sim.bm, window, max_skips)
    return sim


def run_to_end(sim: Sim) -> None:
    while sim.sched.has_unfinished():
        sim.step()


def test_longest_cached_prefix_goes_first():
    """A finished request leaves 4 blocks cached; of three later requests the one sharing 4 blocks is admitted
    first, then the one sharing 2, then the unrelated one that came first."""
    sim = lpm_sim(num_blocks=40, block_size=4, max_num_seqs=1, budget=64)
    base = list(range(1, 18))  # 17 tokens: 4 full blocks
    sim.add(prompt_request("base", base, 2))
    run_to_end(sim)
    unrelated = sim.add(prompt_request("unrelated", list(range(100, 120)), 1))
    two = sim.add(prompt_request("two", base[:8] + [200] * 9, 1))
    four = sim.add(prompt_request("four", base + [300] * 3, 1))
    sim.sched.waiting.rank()
    assert list(sim.sched.waiting) == [four, two, unrelated]
    assert [w.score for w in sim.sched.waiting.waiting()] == [4, 2, 0]
    admitted = []
    while sim.sched.has_unfinished():
        sim.step()
        admitted += [g.request_id for g in sim.sched.running if g.request_id not in admitted]
        admitted += [r for r in sim.finished if r not in admitted]
    assert admitted[1:] == ["four", "two", "unrelated"]
    assert sim.bm.prefix_cache_hits == (4 + 2) * 4  # the two hits, in tokens


def test_no_prefix_cache_means_arrival_order():
    sim = lpm_sim(num_blocks=40, block_size=4, max_num_seqs=1, budget=64)
    sim.bm.enable_prefix_caching = False
    groups = [sim.add(prompt_request(f"r{i}", list(range(1, 10 + i)), 1)) for i in range(4)]
    sim.sched.waiting.rank()
    assert list(sim.sched.waiting) == groups


def test_an_overtaken_request_goes_first_after_max_skips():
    """A stream of requests hitting the cache overtakes an unrelated one at most max_skips times."""
    sim = lpm_sim(num_blocks=64, block_size=4, max_num_seqs=1, budget=64, max_skips=3)
    base = list(range(1, 18))
    sim.add(prompt_request("base", base, 1))
    run_to_end(sim)
    order = []
    lonely = sim.add(prompt_request("lonely", list(range(500, 520)), 1))
    for i in range(8):
        sim.add(prompt_request(f"hit{i}", base + [600 + i], 1))
    while sim.sched.has_unfinished():
        before = set(sim.live)
        sim.step()
        order += sorted(before - set(sim.live), key=lambda r: (r != "lonely", r))
    assert order.index("lonely") == 3 and lonely.seqs[0].is_finished


def test_window_bounds_the_scored_requests():
    """Only the `window` earliest waiting requests are scored; later ones wait in arrival order, unscored."""
    sim = lpm_sim(num_blocks=64, block_size=4, max_num_seqs=1, budget=64, window=2)
    base = list(range(1, 18))
    sim.add(prompt_request("base", base, 1))
    run_to_end(sim)
    a = sim.add(prompt_request("a", list(range(500, 520)), 1))
    b = sim.add(prompt_request("b", base[:8] + [7] * 5, 1))
    c = sim.add(prompt_request("c", base + [9], 1))  # the best match, outside the window
    sim.sched.waiting.rank()
    assert list(sim.sched.waiting) == [b, a, c]
    assert [w.score for w in sim.sched.waiting.waiting()] == [2, 0, 0] and not c.seqs[0].num_computed_tokens


def test_remove_and_membership():
    q = LongestPrefixQueue(Sim(8, 4, 2, 8).bm)
    groups = [SequenceGroup.make(request(f"r{i}", 5, 2)) for i in range(3)]
    for g in groups:
        q.append(g)
    q.appendleft(preempted := SequenceGroup.make(request("p", 5, 2)))
    assert list(q) == [preempted, *groups] and len(q) == 4 and groups[1] in q
    q.remove(groups[1])
    assert groups[1] not in q and q.popleft() is preempted and q[0] is groups[0] and len(q) == 2
    with pytest.raises(ValueError):
        q.remove(groups[1])


# ---- random workloads ---------------------------------------------------------------------------------------------
def chat_request(rng: random.Random, step: int, bases: list[list[int]], num_blocks: int, block_size: int,
                 max_num_seqs: int) -> Sequence:
    """A prompt that begins with part of one of a few shared histories (so the cache hits), then its own tokens."""
    n = rng.randint(1, min(2, max_num_seqs))
    capacity = num_blocks // n * block_size
    base = rng.choice(bases)
    shared = base[:rng.randint(0, min(len(base), capacity // 2))]
    own = [rng.randrange(1000, 2000) for _ in range(rng.randint(1, max(1, capacity // 4)))]
    prompt = (shared + own)[:max(1, capacity // 2)]
    max_tokens = rng.randint(1, max(1, min(20, capacity - len(prompt))))
    return prompt_request(f"r{step}", prompt, max_tokens, n, arrival=float(step))


class Watch:
    """Records, at every rank(), the queue's order and its scores beside match_prefix's own count; and whether an
    admission made an overtaken request urgent (it then goes first: the order changes within the step)."""

    def __init__(self, sim: Sim) -> None:
        self.sim, self.queue = sim, sim.sched.waiting
        self.snapshot: list[tuple[SequenceGroup, int, int, bool]] = []
        self.promoted = False
        self.popped: list[str] = []  # the step's admissions in the order they happened
        rank, skip_over = self.queue.rank, self.queue.skip_over

        def recording_rank() -> None:
            rank()
            front = self.queue.front()
            self.snapshot = [(w.group, w.score, self.matched(w.group), w.urgent(self.queue.max_skips))
                             for w in front]

        def recording_skip_over(admitted: Waiting) -> None:
            self.popped.append(admitted.group.request_id)
            urgent = self.num_urgent()
            skip_over(admitted)
            self.promoted |= self.num_urgent() > urgent

        self.queue.rank = recording_rank
        self.queue.skip_over = recording_skip_over

    def num_urgent(self) -> int:
        return sum(w.urgent(self.queue.max_skips) for w in self.queue.waiting())

    def matched(self, group: SequenceGroup) -> int:
        return len(self.sim.bm.match_prefix(group.seqs[0].token_ids).blocks)


@settings(max_examples=60, deadline=None)
@given(block_size=st.sampled_from([1, 4, 16]), num_blocks=st.integers(8, 40), max_num_seqs=st.integers(1, 6),
       budget=st.integers(1, 48), window=st.integers(1, 8), max_skips=st.integers(1, 5),
       seed=st.integers(0, 10_000))
def test_random_workload_loses_nothing_keeps_order_and_bounds_overtaking(block_size, num_blocks, max_num_seqs, budget,
                                                                         window, max_skips, seed):
    """Every request finishes whole and the block invariants hold after every step (Sim.step); at every ranked step
    the scores are what match_prefix finds (check_ranked), urgent requests come first and the rest by score, and the
    admitted groups are the front of that order (unless an admission made an overtaken one urgent); no request's first
    admission comes after more than max_skips first admissions of requests that arrived after it."""
    rng = random.Random(seed)
    sim = lpm_sim(num_blocks, block_size, max_num_seqs, budget, window, max_skips)
    sim.next_token = lambda seq: rng.randrange(3)
    watch = Watch(sim)
    bases = [[rng.randrange(1, 50) for _ in range(num_blocks * block_size)] for _ in range(3)]
    workload = RandomWorkload(sim, rng, lambda step: chat_request(rng, step, bases, num_blocks, block_size,
                                                                  max_num_seqs))
    first_admitted: list[str] = []
    for _ in workload.steps():
        watch.snapshot, watch.promoted, watch.popped = [], False, []
        sim.step()
        admitted = [g for g, *_ in watch.snapshot if g not in sim.sched.waiting]
        if not watch.promoted:
            assert [g for g, *_ in watch.snapshot[:len(admitted)]] == admitted, "admitted out of the ranked order"
        check_ranked(watch.snapshot, sim.bm.pool.num_evictions)
        # in the order admissions happened (a promotion reorders the step), a group admitted and preempted within
        # the step included: its admission overtook those before it
        first_admitted += [rid for rid in watch.popped if rid not in first_admitted]
    workload.check_all_done()
    arrival = {rid: i for i, rid in enumerate(workload.submitted)}
    for i, rid in enumerate(first_admitted):
        overtaken_by = sum(arrival[other] > arrival[rid] for other in first_admitted[:i])
        assert overtaken_by <= max_skips, f"{rid} was overtaken {overtaken_by} times"


def check_ranked(snapshot: list[tuple[SequenceGroup, int, int, bool]], evictions: int) -> None:
    """Urgent first, then longest prefix first; a score counts what match_prefix finds, or more only once a block
    was evicted (a parent recomputed under a new content id: match_prefix then refuses its cached children)."""
    urgent = [u for *_, u in snapshot]
    assert urgent == sorted(urgent, reverse=True), "an urgent request is behind a scored one"
    scores = [score for _, score, _, u in snapshot if not u]
    assert scores == sorted(scores, reverse=True), "not longest prefix first"
    for group, score, matched, _ in snapshot:
        assert score == matched or score > matched and evictions, \
            f"{group.request_id}: scored {score}, match_prefix finds {matched}"
