"""The priority and fair (VTC) scheduling policies without a model: random workloads keep the block invariants and
finish every request; priority order holds at admission and preemption with no ping-pong; VTC keeps backlogged
clients' service within its bound."""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Iterator

from hypothesis import given, settings
from hypothesis import strategies as st
from test_scheduler import Sim

from pagedllm.config import SchedulerConfig
from pagedllm.core import policies
from pagedllm.core.baselines import make_scheduler
from pagedllm.core.fairness import INPUT_WEIGHT, OUTPUT_WEIGHT, VirtualTokenCounter, max_service_gap
from pagedllm.core.plan import SchedulerOutput
from pagedllm.core.policies import DISPLACEMENT_FLOOR, FairScheduler, PriorityScheduler, priority_key
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.sequence import Sequence, SequenceGroup
from pagedllm.outputs import RequestMetrics
from pagedllm.sampling_params import SamplingParams


def request(rid: str, prompt_len: int, max_tokens: int, n: int = 1, priority: int = 0, client: str | None = None,
            arrival: float = 0.0, first: int = 1) -> Sequence:
    """Prompts first, first + 1, ...: with the same `first` they share prefixes, so the prefix cache plays too."""
    params = SamplingParams(max_tokens=max_tokens, n=n, priority=priority, client=client)
    return Sequence(rid, None, list(range(first, first + prompt_len)), params, RequestMetrics(arrival),
                    max_tokens=max_tokens)


def policy_sim(cls: type[Scheduler], num_blocks: int, block_size: int, max_num_seqs: int, budget: int,
               **kwargs: object) -> Sim:
    sim = Sim(num_blocks, block_size, max_num_seqs, budget)
    sim.sched = cls(sim.bm, max_num_seqs, budget, **kwargs)
    return sim


def random_request(rng: random.Random, step: int, num_blocks: int, block_size: int, max_num_seqs: int,
                   clients: int = 3) -> Sequence:
    n = rng.randint(1, min(3, max_num_seqs))
    capacity = num_blocks // n * block_size
    prompt = rng.randint(1, max(1, capacity // 2))
    max_tokens = rng.randint(1, max(1, min(40, capacity - prompt)))
    return request(f"r{step}", prompt, max_tokens, n, priority=rng.randint(0, 3), client=f"c{rng.randrange(clients)}",
                   arrival=float(step))


def test_make_scheduler_picks_the_policy():
    for policy, cls in (("fcfs", Scheduler), ("priority", PriorityScheduler), ("fair", FairScheduler)):
        assert type(make_scheduler(SchedulerConfig(scheduling_policy=policy), 64)) is cls
    fair = make_scheduler(SchedulerConfig(scheduling_policy="fair", client_weights={"a": 2.0}), 64)
    assert isinstance(fair, FairScheduler) and fair.vtc.weights == {"a": 2.0}


@settings(max_examples=80, deadline=None)
@given(policy=st.sampled_from([PriorityScheduler, FairScheduler]), block_size=st.sampled_from([1, 4, 16]),
       num_blocks=st.integers(8, 40), max_num_seqs=st.integers(1, 6), budget=st.integers(1, 48),
       seed=st.integers(0, 10_000))
def test_random_workload_loses_nothing_and_keeps_order(policy, block_size, num_blocks, max_num_seqs, budget, seed):
    """Every request finishes whole, the blocks' invariants hold after every step (Sim.step checks them), a step that
    preempts no one is never empty while anything waits or runs (under fair, a held prompt runs if the pick does not
    get in), a displacement takes only running groups below DISPLACEMENT_FLOOR, and under priority: admission takes a
    prefix of the queue in key order, and a preempted group is the lowest-priority running one unless the others
    were floored."""
    rng = random.Random(seed)
    sim = policy_sim(policy, num_blocks, block_size, max_num_seqs, budget)
    sim.next_token = lambda seq: rng.randrange(3)
    plans = record_plans(sim)
    workload = RandomWorkload(sim, rng, lambda step: random_request(rng, step, num_blocks, block_size, max_num_seqs))
    for _ in workload.steps():
        waiting, running = list(sim.sched.waiting), list(sim.sched.running)
        before = {id(g): g.num_preemptions for g in waiting + running}
        displaced = sim.sched.num_displacements
        sim.step()
        assert plans[-1].scheduled or plans[-1].preempted or not (waiting or running), "an idle step"
        still_waiting = {id(g) for g in sim.sched.waiting}
        victims = [g for g in running if id(g) in still_waiting]
        if sim.sched.num_displacements > displaced:  # a displacement step preempts only for the waiting head
            assert sim.sched.num_displacements - displaced == len(victims)
            assert all(before[id(v)] < DISPLACEMENT_FLOOR for v in victims)
        if policy is PriorityScheduler:
            check_priority_step(sim.sched, waiting, running, victims, displaced)
    workload.check_all_done()


class RandomWorkload:
    """Arrivals for 60 steps (0.4 a step), a 2% chance of an abort at every step, until nothing is left; `steps()`
    yields before each step, which the caller runs; `check_all_done` then asserts nothing was lost."""

    def __init__(self, sim: Sim, rng: random.Random, make: Callable[[int], Sequence]) -> None:
        self.sim, self.rng, self.make = sim, rng, make
        self.submitted: list[str] = []
        self.aborted: set[str] = set()

    def steps(self) -> Iterator[int]:
        sim, rng = self.sim, self.rng
        for step in range(4000):
            if step < 60 and rng.random() < 0.4:
                seq = self.make(step)
                sim.add(seq)
                self.submitted.append(seq.request_id)
            if sim.live and rng.random() < 0.02:
                rid = rng.choice(sorted(sim.live))
                self.aborted.add(rid)
                sim.abort(rid)
            if step >= 60 and not sim.sched.has_unfinished():
                return
            yield step

    def check_all_done(self) -> None:
        sim = self.sim
        assert not sim.sched.has_unfinished(), "requests were left behind (livelock or lost request)"
        assert sim.bm.num_free_blocks == sim.bm.num_total_blocks
        assert set(sim.finished) | self.aborted == set(self.submitted)
        for rid, group in sim.finished.items():
            assert all(seq.num_output_tokens == seq.max_tokens for seq in group.seqs), rid


def check_priority_step(sched: PriorityScheduler, waiting: list[SequenceGroup], running: list[SequenceGroup],
                        victims: list[SequenceGroup], displaced: int) -> None:
    still_waiting = {id(g) for g in sched.waiting}
    admitted = [g for g in waiting if id(g) not in still_waiting]
    if admitted and sched.waiting:
        assert max(map(priority_key, admitted)) < min(map(priority_key, sched.waiting)), "admitted out of order"
    for v in victims:
        for r in sched.running:
            assert priority_key(r) < priority_key(v) or r.num_preemptions >= DISPLACEMENT_FLOOR, \
                "preempted a higher priority than one left running"
    if sched.num_displacements > displaced:  # displaced for the head: only strictly lower priorities
        head = min(admitted, key=priority_key)
        assert all(v.priority > head.priority for v in victims)


def test_high_priority_request_displaces_low_priority_ones():
    sim = policy_sim(PriorityScheduler, num_blocks=8, block_size=4, max_num_seqs=8, budget=64)
    lows = [sim.add(request(f"low{i}", 7, 20, priority=5, arrival=i)) for i in range(4)]
    sim.step()  # all four prefill: 2 blocks each, the pool is full
    assert sim.bm.num_free_blocks == 0 and len(sim.sched.running) == 4
    high = sim.add(request("high", 6, 4, priority=0, arrival=10))
    sim.step()
    assert high in sim.sched.running and sim.sched.num_displacements >= 1
    assert lows[-1].status.value == "waiting"  # the newest of the lowest priority went first
    while sim.sched.has_unfinished():
        sim.step()
    assert sorted(sim.finished) == sorted(["high"] + [f"low{i}" for i in range(4)])


def test_equal_priorities_never_displace_each_other():
    sim = policy_sim(PriorityScheduler, num_blocks=4, block_size=4, max_num_seqs=8, budget=64)
    sim.add(request("a", 8, 30, priority=1, arrival=0))
    sim.add(request("b", 8, 30, priority=1, arrival=1))
    sim.step()
    sim.add(request("c", 8, 30, priority=1, arrival=2))
    for _ in range(5):
        sim.step()
    assert sim.sched.num_displacements == 0


def test_displacement_stops_at_the_floor():
    """A stream of high-priority requests preempts one low-priority request at most DISPLACEMENT_FLOOR times."""
    sim = policy_sim(PriorityScheduler, num_blocks=6, block_size=4, max_num_seqs=8, budget=64)
    low = sim.add(request("low", 16, 6, priority=9, arrival=0))  # 4 of the 6 blocks, 6 at the end
    sim.step()
    for i in range(2 * DISPLACEMENT_FLOOR + 2):
        sim.add(request(f"high{i}", 12, 2, priority=0, arrival=1 + i, first=100))  # never fits beside it
        for _ in range(3):
            sim.step()
    assert sim.sched.num_displacements == low.num_preemptions == DISPLACEMENT_FLOOR
    while sim.sched.has_unfinished():
        sim.step()
    assert "low" in sim.finished


def record_plans(sim: Sim) -> list[SchedulerOutput]:
    """Every plan the scheduler makes from now on."""
    plans: list[SchedulerOutput] = []
    schedule = sim.sched.schedule
    sim.sched.schedule = lambda: plans.append(schedule()) or plans[-1]
    return plans


def first_tokens(plan: SchedulerOutput) -> set[str]:
    return {s.seq.request_id for s in plan.scheduled if s.samplers and s.start < s.seq.num_prompt_tokens}


def prompt_tokens(plan: SchedulerOutput, prefix: str) -> int:
    return sum(s.num_new_tokens for s in plan.scheduled
               if s.seq.request_id.startswith(prefix) and s.start < s.seq.num_prompt_tokens)


def test_a_light_client_below_its_seat_share_displaces_the_heavy_client_at_once():
    """fair: a heavy client holds every seat with more queued; a light client's request, lifted to the heavy client's
    counter (a tie, which goes to the client holding fewer seats), displaces the heavy client's newest running
    request in the first step after it arrives and samples its first token there; the heavy client keeps the other
    seats, and everything finishes."""
    sim = policy_sim(FairScheduler, num_blocks=64, block_size=4, max_num_seqs=4, budget=64)
    plans = record_plans(sim)
    heavy = [sim.add(request(f"heavy{i}", 8, 30, client="heavy", arrival=i)) for i in range(6)]
    sim.step()
    sim.step()
    assert len(sim.sched.running) == 4
    light = sim.add(request("light", 4, 2, client="light", arrival=10, first=200))
    assert sim.sched.vtc.counter("light") == sim.sched.vtc.counter("heavy")
    sim.step()
    assert first_tokens(plans[-1]) == {"light"} and plans[-1].preempted == [heavy[3]]
    assert sim.sched.num_displacements == 1 and heavy[3].status.value == "waiting" and len(sim.sched.running) == 4
    while sim.sched.has_unfinished():
        sim.step()
    assert sorted(sim.finished) == sorted(["light"] + [f"heavy{i}" for i in range(6)])
    assert light.num_preemptions == 0 and sim.sched.num_displacements == 1


def test_light_requests_arriving_together_all_get_in_at_the_next_step():
    """fair: three light clients' requests arrive in the same step while a heavy client holds every seat: each is
    below its share (4 seats / 4 clients), so each displaces a heavy request, all in the next step, and each samples
    its first token there; the heavy client keeps one seat."""
    sim = policy_sim(FairScheduler, num_blocks=64, block_size=4, max_num_seqs=4, budget=64)
    plans = record_plans(sim)
    for i in range(6):
        sim.add(request(f"heavy{i}", 8, 30, client="heavy", arrival=i))
    sim.step()
    sim.step()
    for i in range(3):
        sim.add(request(f"light{i}", 4, 2, client=f"light{i}", arrival=10 + i, first=200 + 10 * i))
    sim.step()
    assert first_tokens(plans[-1]) == {"light0", "light1", "light2"} and len(plans[-1].preempted) == 3
    assert [g.client for g in sim.sched.running].count("heavy") == 1
    while sim.sched.has_unfinished():
        sim.step()
    assert len(sim.finished) == 9 and sim.sched.num_displacements == 3


def test_a_light_prompt_runs_in_a_step_without_the_heavy_clients_prompts(monkeypatch):
    """fair: a light request that arrives with a heavy client's batch, or beside a heavy prompt being prefilled in
    chunks, is admitted in the next step and computes its prompt there with only the running decodes: the heavy
    prompts (whose client wants more than its share of the seats) wait that one step, then go on, PACED_PROMPT_TOKENS
    (16 here: one prompt) a step while the light request runs."""
    monkeypatch.setattr(policies, "PACED_PROMPT_TOKENS", 16)
    sim = policy_sim(FairScheduler, num_blocks=64, block_size=4, max_num_seqs=4, budget=64)
    plans = record_plans(sim)
    for i in range(6):
        sim.add(request(f"heavy{i}", 16, 4, client="heavy", arrival=i, first=300 + 20 * i))
    sim.add(request("light", 8, 4, client="light", arrival=10, first=200))
    sim.step()
    assert first_tokens(plans[-1]) == {"light"} and prompt_tokens(plans[-1], "heavy") == 0
    for _ in range(3):  # then one heavy prompt a step while the light request runs
        sim.step()
        assert prompt_tokens(plans[-1], "heavy") == 16
    assert "light" in sim.finished and len(sim.sched.running) == 3

    sim = policy_sim(FairScheduler, num_blocks=64, block_size=4, max_num_seqs=2, budget=12)
    plans = record_plans(sim)
    sim.add(request("heavy0", 40, 4, client="heavy", arrival=0))  # 4 chunks of 12 (10 tokens in the last)
    sim.add(request("heavy1", 40, 4, client="heavy", arrival=1))
    sim.step()
    light = sim.add(request("light", 8, 2, client="light", arrival=10, first=200))
    sim.step()
    assert first_tokens(plans[-1]) == {"light"} and prompt_tokens(plans[-1], "heavy") == 0 and light.is_decoding
    sim.step()
    assert prompt_tokens(plans[-1], "heavy") == 11  # the chunk goes on beside the light decode
    while sim.sched.has_unfinished():
        sim.step()
    assert sorted(sim.finished) == ["heavy0", "heavy1", "light"]


def light_served_then_heavy_batch(num_blocks: int, heavy: int, prompt_len: int,
                                  max_tokens: int) -> tuple[Sim, list[SchedulerOutput]]:
    """fair, 4 seats: a light client's request served to its end, then a heavy client's batch queued."""
    sim = policy_sim(FairScheduler, num_blocks=num_blocks, block_size=4, max_num_seqs=4, budget=64)
    plans = record_plans(sim)
    sim.add(request("light-a", 8, 4, client="light", arrival=0, first=200))
    while sim.sched.has_unfinished():
        sim.step()
    for i in range(heavy):
        sim.add(request(f"heavy{i}", prompt_len, max_tokens, client="heavy", arrival=10 + i, first=300 + 30 * i))
    return sim, plans


def test_a_returning_light_client_served_more_still_prompts_without_the_heavy_clients_prompts():
    """fair: a light client served before (its counter above the last one to leave the queue, which a new heavy
    client is lifted to) returns in the same step as the heavy client's batch: the heavy client is the queue's pick,
    but its prompts wait that step, so the light prompt runs with no heavy prompt beside it."""
    sim, plans = light_served_then_heavy_batch(num_blocks=64, heavy=6, prompt_len=16, max_tokens=4)
    sim.add(request("light-b", 8, 2, client="light", arrival=20, first=250))
    vtc = sim.sched.vtc
    assert vtc.counter("light") > vtc.counter("heavy") and sim.sched.waiting[0].client == "heavy"
    sim.step()
    assert first_tokens(plans[-1]) == {"light-b"} and prompt_tokens(plans[-1], "heavy") == 0
    sim.step()
    assert prompt_tokens(plans[-1], "heavy") == 48  # then PACED_PROMPT_TOKENS at most while the light request runs
    while sim.sched.has_unfinished():
        sim.step()
    assert len(sim.finished) == 8


def test_a_client_over_its_share_prompts_in_short_chunks_while_others_are_about(monkeypatch):
    """fair: while a light client runs, or was served in the last PACE_WINDOW_STEPS steps, the heavy client starts one
    prompt a step and computes at most PACED_PROMPT_TOKENS of it (a light request arriving meanwhile waits for a short
    step); once it has been alone for the window, its prompts go in whole, several a step."""
    monkeypatch.setattr(policies, "PACED_PROMPT_TOKENS", 8)
    monkeypatch.setattr(policies, "PACE_WINDOW_STEPS", 6)
    sim, plans = light_served_then_heavy_batch(num_blocks=256, heavy=12, prompt_len=20, max_tokens=30)
    for _ in range(4):  # the light client was served 1-4 steps ago: chunks of 8, 8, 4 (the prompt's end), 8
        sim.step()
        assert 0 < prompt_tokens(plans[-1], "heavy") <= 8
    while not plans[-1].preempted and prompt_tokens(plans[-1], "heavy") <= 8 and len(plans) < 40:
        sim.step()
    assert prompt_tokens(plans[-1], "heavy") > 20  # alone for the window: whole prompts, more than one a step
    while sim.sched.has_unfinished():
        sim.step()
    assert len(sim.finished) == 13


def test_a_batch_on_an_idle_server_prompts_in_short_chunks_until_it_has_been_alone_for_the_window(monkeypatch):
    """fair: a server that was idle cannot know who comes next: for PACE_WINDOW_STEPS steps a client with more than one
    request computes at most PACED_PROMPT_TOKENS prompt tokens a step (a light request arriving with its first step
    waits for a short step), then whole prompts again; a lone request (a chat turn, even with n=2) is not paced, but
    alone on the server it starts small (`test_a_lone_request_starts_its_prompt_small...`)."""
    monkeypatch.setattr(policies, "PACED_PROMPT_TOKENS", 8)
    monkeypatch.setattr(policies, "PACE_WINDOW_STEPS", 6)
    sim = policy_sim(FairScheduler, num_blocks=256, block_size=4, max_num_seqs=4, budget=64)
    plans = record_plans(sim)
    for i in range(12):
        sim.add(request(f"heavy{i}", 20, 30, client="heavy", arrival=10 + i, first=300 + 30 * i))
    sim.step()
    assert prompt_tokens(plans[-1], "heavy") == 8
    light = sim.add(request("light", 8, 2, client="light", arrival=20, first=200))
    sim.step()
    assert first_tokens(plans[-1]) == {"light"} and prompt_tokens(plans[-1], "heavy") == 0
    while "light" not in sim.finished:
        sim.step()
    assert light.num_preemptions == 0
    while not plans[-1].preempted and prompt_tokens(plans[-1], "heavy") <= 8 and len(plans) < 60:
        sim.step()
    assert prompt_tokens(plans[-1], "heavy") >= 20 and len(plans) < 60  # alone for the window: whole prompts
    while sim.sched.has_unfinished():
        sim.step()
    assert len(sim.finished) == 13
    sim.add(request("chat", 40, 2, client="chat", arrival=90, first=500))  # the server idle again
    assert lone_prompt_chunks(sim, plans, "chat") == [40]  # heavy, served in the window, is about: chat, the
    sim = policy_sim(FairScheduler, num_blocks=256, block_size=4, max_num_seqs=4, budget=64)  # least served, whole
    plans = record_plans(sim)
    sim.add(request("chat", 40, 2, n=2, client="chat", arrival=0, first=500))  # a fresh server, 2 samples: one request
    assert lone_prompt_chunks(sim, plans, "chat") == [8, 8, 16, 8]


def lone_prompt_chunks(sim: Sim, plans: list[SchedulerOutput], prefix: str) -> list[int]:
    """The prompt tokens of `prefix`'s requests in each step until their first token."""
    chunks: list[int] = []
    while not chunks or not first_tokens(plans[-1]) & {s.seq.request_id for s in plans[-1].scheduled
                                                       if s.seq.request_id.startswith(prefix)}:
        sim.step()
        chunks.append(prompt_tokens(plans[-1], prefix))
    return chunks


def test_a_lone_request_starts_its_prompt_small_and_a_newcomer_gets_in_after_the_first_chunk(monkeypatch):
    """fair: a client's only request computes PACED_PROMPT_TOKENS of its prompt, then as many as it has computed, up
    to LONE_PROMPT_TOKENS a step (a request arriving with it waits for a short step, not the whole prompt's); a light
    request arriving after its first chunk samples its first token in the next step, the long prompt held for that
    step and paced while the light client is about; alone again for the window, it goes on in LONE_PROMPT_TOKENS
    chunks. Under fcfs the same prompt fills the budget."""
    monkeypatch.setattr(policies, "PACED_PROMPT_TOKENS", 8)
    monkeypatch.setattr(policies, "PACE_WINDOW_STEPS", 6)
    monkeypatch.setattr(policies, "LONE_PROMPT_TOKENS", 32)
    sim = policy_sim(FairScheduler, num_blocks=256, block_size=4, max_num_seqs=4, budget=64)
    plans = record_plans(sim)
    sim.add(request("doc0", 100, 2, client="heavy", arrival=0, first=300))
    assert lone_prompt_chunks(sim, plans, "doc0") == [8, 8, 16, 32, 32, 4]
    while sim.sched.has_unfinished():
        sim.step()
    sim.add(request("doc1", 200, 2, client="heavy", arrival=10, first=600))
    sim.step()
    assert prompt_tokens(plans[-1], "doc1") == 8
    sim.add(request("light", 8, 2, client="light", arrival=11, first=200))
    sim.step()
    assert first_tokens(plans[-1]) == {"light"} and prompt_tokens(plans[-1], "doc1") == 0
    sim.step()
    assert prompt_tokens(plans[-1], "doc1") == 8  # paced: served far ahead of the light client, which is about
    chunks = lone_prompt_chunks(sim, plans, "doc1")
    assert set(chunks[:4]) == {8} and chunks[-2] == 32  # the light client gone for the window: 32 a step
    while sim.sched.has_unfinished():
        sim.step()
    assert sorted(sim.finished) == ["doc0", "doc1", "light"]
    sim = policy_sim(Scheduler, num_blocks=256, block_size=4, max_num_seqs=4, budget=64)
    plans = record_plans(sim)
    sim.add(request("doc0", 100, 2, client="heavy", arrival=0, first=300))
    assert lone_prompt_chunks(sim, plans, "doc0") == [64, 36]


def test_a_client_served_far_ahead_prompts_in_short_chunks_even_within_its_seats(monkeypatch):
    """fair: a client sending long prompts one at a time holds one seat, within its share; once its prompt puts it
    more than PACED_PROMPT_TOKENS ahead of a light client that is about, its prompt is computed PACED_PROMPT_TOKENS a
    step (a light request arriving meanwhile waits for a short step, not a whole prompt's); the light client, least
    served, computes its longer prompt whole, in a step without the heavy prompt; alone for the window, the heavy
    prompt goes on in longer chunks again."""
    monkeypatch.setattr(policies, "PACED_PROMPT_TOKENS", 8)
    monkeypatch.setattr(policies, "PACE_WINDOW_STEPS", 6)
    sim = policy_sim(FairScheduler, num_blocks=256, block_size=4, max_num_seqs=4, budget=64)
    plans = record_plans(sim)
    sim.add(request("light-a", 8, 2, client="light", arrival=0, first=200))
    while sim.sched.has_unfinished():
        sim.step()
    sim.add(request("doc0", 40, 2, client="heavy", arrival=10, first=300))
    sim.step()
    assert prompt_tokens(plans[-1], "doc0") == 8  # its prompt will put it 40 ahead of the light client: starts small
    while sim.sched.has_unfinished():
        sim.step()
    sim.add(request("doc1", 160, 2, client="heavy", arrival=20, first=400))
    sim.step()
    assert prompt_tokens(plans[-1], "doc1") == 8  # now 40 ahead of the light client, which was served 3 steps ago
    sim.add(request("light-b", 20, 2, client="light", arrival=21, first=500))
    sim.step()
    assert prompt_tokens(plans[-1], "light-b") == 20 and prompt_tokens(plans[-1], "doc1") == 0  # held that step
    sim.step()
    assert prompt_tokens(plans[-1], "doc1") == 8
    while prompt_tokens(plans[-1], "doc1") <= 8 and "doc1" not in sim.finished:
        sim.step()
    assert prompt_tokens(plans[-1], "doc1") > 8  # the light client gone for the window: the rest of it whole
    while sim.sched.has_unfinished():
        sim.step()
    assert sorted(sim.finished) == ["doc0", "doc1", "light-a", "light-b"]


def test_a_pick_that_does_not_get_in_leaves_no_step_empty():
    """fair: a light request with a free seat holds the heavy prompt back, but its first chunk needs more blocks than
    are free: the step runs the heavy chunk after all (never an empty step), and the light request is not held for
    again; it gets in when the heavy request ends."""
    sim = policy_sim(FairScheduler, num_blocks=8, block_size=4, max_num_seqs=2, budget=12)
    plans = record_plans(sim)
    sim.add(request("heavy0", 30, 2, client="heavy", arrival=0))  # chunks of 12: 6 of the 8 blocks after two
    sim.add(request("heavy1", 30, 2, client="heavy", arrival=1, first=300))
    sim.step()
    sim.step()
    light = sim.add(request("light", 12, 2, client="light", arrival=10, first=200))  # 3 blocks; 2 are free
    sim.step()
    assert [(s.seq.request_id, s.start) for s in plans[-1].scheduled] == [("heavy0", 24)]
    while sim.sched.has_unfinished():
        sim.step()
        assert not plans[-1].is_empty
    assert sorted(sim.finished) == ["heavy0", "heavy1", "light"] and light.num_preemptions == 0


def test_a_client_at_its_seat_share_displaces_nobody():
    sim = policy_sim(FairScheduler, num_blocks=64, block_size=4, max_num_seqs=2, budget=64)
    sim.add(request("a0", 8, 30, client="a", arrival=0))
    sim.add(request("b0", 8, 30, client="b", arrival=1))
    sim.step()
    sim.add(request("b1", 8, 30, client="b", arrival=2))  # b holds its share (1 of 2 seats)
    for _ in range(5):
        sim.step()
    assert sim.sched.num_displacements == 0


# ---- VTC -----------------------------------------------------------------------------------------------------------
def test_vtc_lifts_a_returning_client_to_the_least_waiting_counter():
    vtc = VirtualTokenCounter()
    a, b, c = (SequenceGroup.make(request(x, 4, 4, client=x)) for x in "abc")
    vtc.append(a)
    vtc.append(b)
    vtc.charge("a", 100)
    vtc.charge("b", 40)
    vtc.append(c)  # new client: starts at the least waiting counter, not at 0
    assert vtc.counter("c") == 40 and vtc[0] in (b, c) and len(vtc) == 3
    assert vtc.popleft() is b  # b and c tie at 40; b has waited longer
    assert vtc.popleft() is c and vtc.popleft() is a and not vtc
    assert vtc.last_left == 100
    d = SequenceGroup.make(request("d", 4, 4, client="d"))
    vtc.append(d)  # nobody waits: lifted to the last to leave
    assert vtc.counter("d") == 100


def test_vtc_breaks_ties_by_its_tie_break_then_by_waiting_time():
    vtc = VirtualTokenCounter()
    a, b, c = (SequenceGroup.make(request(x, 4, 4, client=x)) for x in "abc")
    for g in (a, b, c):
        vtc.append(g)
    assert vtc[0] is a and list(vtc) == [a, b, c]  # all at 0: the one waiting longest
    vtc.tie_break = {"a": (2.0, 0.0), "b": (1.0, 5.0), "c": (1.0, 3.0)}.__getitem__
    assert vtc[0] is c and list(vtc) == [c, b, a]
    vtc.charge("c", 1)
    assert vtc[0] is b and list(vtc) == [b, a, c]  # the counter comes first


def test_vtc_forgets_idle_clients_a_lift_would_raise_anyway(monkeypatch):
    monkeypatch.setattr("pagedllm.core.fairness.KEPT_COUNTERS", 8)
    vtc = VirtualTokenCounter()
    vtc._prune_at = 8
    vtc.append(SequenceGroup.make(request("busy", 4, 4, client="busy")))  # always waiting, served on and on
    vtc.charge("rich", 10_000)  # served a lot, now idle: kept
    for i in range(40):  # one-off clients, each served a little and gone
        g = SequenceGroup.make(request(f"x{i}", 4, 4, client=f"x{i}"))
        vtc.append(g)  # lifted to busy's counter
        vtc.charge(f"x{i}", 1)
        vtc.remove(g)
        vtc.charge("busy", 10)
    assert len(vtc.counters) <= 16 and vtc.counter("rich") == 10_000 and len(vtc) == 1
    late = SequenceGroup.make(request("x0", 4, 4, client="x0"))
    vtc.append(late)  # a forgotten client comes back where a lift puts it
    assert vtc.counter("x0") == vtc.counter("busy")


def service_gap(cls: type[Scheduler], workload: list[tuple[int, Sequence]], num_blocks: int, block_size: int,
                    max_num_seqs: int, budget: int) -> tuple[float, int]:
    """The largest change of one client's service minus another's over a stretch when both were backlogged, and the
    number of steps. Service is measured here, not read from the counters: the prompt (w_p per token) when a request
    is first scheduled, w_q per token sampled."""
    sim = policy_sim(cls, num_blocks, block_size, max_num_seqs, budget)
    clients = sorted({seq.params.client for _, seq in workload})
    service = dict.fromkeys(clients, 0.0)
    started: set[str] = set()
    history: list[dict[str, float]] = []
    backlogged: list[set[str]] = []
    pending = sorted(copy.deepcopy(workload), key=lambda x: x[0])  # the caller may run the workload again
    plans = []
    schedule = sim.sched.schedule
    sim.sched.schedule = lambda: plans.append(schedule()) or plans[-1]
    step = 0
    while pending or sim.sched.has_unfinished():
        while pending and pending[0][0] <= step:
            sim.add(pending.pop(0)[1])
        backlogged.append({g.client for g in sim.sched.waiting})
        sim.step()
        for s in plans[-1].scheduled:
            client = s.seq.params.client
            if s.seq.request_id not in started:
                started.add(s.seq.request_id)
                service[client] += INPUT_WEIGHT * s.seq.num_prompt_tokens
            service[client] += OUTPUT_WEIGHT * len(s.samplers)
        history.append(dict(service))
        step += 1
        assert step < 20_000, "livelock"
    return max_service_gap(list(zip(history, backlogged))), step


@settings(max_examples=60, deadline=None)
@given(num_blocks=st.integers(12, 40), block_size=st.sampled_from([2, 4, 8]), max_num_seqs=st.integers(2, 8),
       budget=st.integers(8, 64), seed=st.integers(0, 10_000))
def test_vtc_keeps_backlogged_clients_within_the_service_bound(num_blocks, block_size, max_num_seqs, budget, seed):
    """Sheng et al.'s bound: two clients backlogged over an interval get service within 2U of each other, U =
    max(w_p * L_input, w_q * M): the most one request's prompt, or the running batch's outputs (M: the tokens the
    pool holds), can add at once."""
    rng = random.Random(seed)
    capacity = num_blocks * block_size
    workload = []
    for i in range(rng.randint(10, 40)):
        prompt = rng.randint(1, capacity // 4)
        client = f"c{rng.randrange(3)}"
        workload.append((rng.randint(0, 80), request(f"r{i}", prompt, rng.randint(1, capacity // 4), client=client)))
    max_input = max(seq.num_prompt_tokens for _, seq in workload)
    bound = 2 * max(INPUT_WEIGHT * max_input, OUTPUT_WEIGHT * capacity)
    gap, _ = service_gap(FairScheduler, workload, num_blocks, block_size, max_num_seqs, budget)
    assert gap <= bound


def test_fcfs_breaks_the_bound_that_vtc_keeps():
    """A heavy client's backlog queued first holds a light client behind it under FCFS, not under VTC."""
    workload = [(0, request(f"heavy{i}", 16, 32, client="heavy")) for i in range(30)]
    workload += [(1 + 4 * i, request(f"light{i}", 8, 8, client="light")) for i in range(10)]
    capacity = 32 * 4
    bound = 2 * max(INPUT_WEIGHT * 16, OUTPUT_WEIGHT * capacity)
    fcfs_gap, _ = service_gap(Scheduler, workload, 32, 4, 4, 64)
    fair_gap, _ = service_gap(FairScheduler, workload, 32, 4, 4, 64)
    assert fcfs_gap > bound >= fair_gap


def test_vtc_weights_share_the_service():
    """Two clients with identical backlogs, one of weight 3: it gets about three times the service meanwhile."""
    sim = policy_sim(FairScheduler, num_blocks=64, block_size=4, max_num_seqs=2, budget=64,
                     client_weights={"big": 3.0})
    for i in range(40):
        sim.add(request(f"big{i}", 4, 4, client="big"))
        sim.add(request(f"small{i}", 4, 4, client="small"))
    while sum(r.startswith("small") for r in sim.finished) < 10:
        sim.step()
    big = sum(r.startswith("big") for r in sim.finished)
    assert 25 <= big <= 35
