"""Who waits and who is preempted, beside the paged policy's FCFS (`--scheduling-policy`): strict priorities and
per-client fairness (the Virtual Token Counter, core/fairness.py). Each is the paged scheduler with its waiting queue
replaced (the queue's front is the policy's pick) and an admission hook or two overridden."""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable, Iterator

from pagedllm.core.block_manager import BlockManager
from pagedllm.core.fairness import INPUT_WEIGHT, OUTPUT_WEIGHT, VirtualTokenCounter
from pagedllm.core.plan import SchedulerOutput
from pagedllm.core.scheduler import Scheduler, Writes
from pagedllm.core.sequence import SequenceGroup

# A group preempted this many times is no longer displaced by a waiting one, and is the last a shortage of blocks
# preempts: no ping-pong, and a low-priority request under a stream of high-priority ones loses its work at most
# this often (unless nothing else is left to preempt)
DISPLACEMENT_FLOOR = 2
# Under fair, while a client within its share runs or was served within the last PACE_WINDOW_STEPS steps, a client
# over its share computes at most PACED_PROMPT_TOKENS prompt tokens a step: a light request arriving meanwhile waits for
# at most such a step (docs/fairness.md, runs 10-12). So does a client with more than one request in the first
# PACE_WINDOW_STEPS steps after the server was idle (nobody knows yet who comes next), and, while another client is
# about, a client served more than PACED_PROMPT_TOKENS ahead of the least-served one (its long prompts, sent one at a
# time within its share of the seats, would otherwise fill whole steps).
PACED_PROMPT_TOKENS = 64
PACE_WINDOW_STEPS = 256
# Under fair, a client's only request (a chat turn, a document sent alone), when its client is alone or its prompt
# puts it ahead of the least-served client (`_slow_starters`), starts its prompt with PACED_PROMPT_TOKENS and then
# computes at most as many tokens a step as it has computed, up to LONE_PROMPT_TOKENS: a request arriving with it (a
# burst, a server's first seconds) waits for a short step, a later one for at most this many tokens.
# Free on the Intel kind without AVX512-BF16 (256-token chunks of 1,024 and 3,072-token prompts; docs/fairness.md)
LONE_PROMPT_TOKENS = 256


def priority_key(group: SequenceGroup) -> tuple[int, float, int]:
    """Priority (lower first), then arrival, then the order requests were made in."""
    first = group.seqs[0]
    return group.priority, first.metrics.arrival_time, first.seq_id


def running_key(group: SequenceGroup) -> tuple[bool, tuple[int, float, int]]:
    """The running order: groups at the floor first (preempted last), then by priority_key."""
    return group.num_preemptions < DISPLACEMENT_FLOOR, priority_key(group)


class PriorityQueue:
    """Waiting groups in priority_key order; a preempted group goes back by its key, not to the front."""

    def __init__(self) -> None:
        self._groups: list[SequenceGroup] = []

    def append(self, group: SequenceGroup) -> None:
        bisect.insort(self._groups, group, key=priority_key)

    appendleft = append

    def popleft(self) -> SequenceGroup:
        return self._groups.pop(0)

    def remove(self, group: SequenceGroup) -> None:
        self._groups.remove(group)

    def __getitem__(self, index: int) -> SequenceGroup:
        return self._groups[index]

    def __len__(self) -> int:
        return len(self._groups)

    def __iter__(self) -> Iterator[SequenceGroup]:
        return iter(self._groups)

    def __contains__(self, group: object) -> bool:
        return group in self._groups


class DisplacingScheduler(Scheduler):
    """The paged scheduler, plus: a waiting head that does not fit displaces the running groups `_displaceable`
    names, in that order, when preempting all of them would make room (so none goes in vain); a group preempted
    DISPLACEMENT_FLOOR times is no longer displaced."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.num_displacements = 0

    def _displaceable(self, head: SequenceGroup) -> list[SequenceGroup]:
        raise NotImplementedError

    def _admit_waiting(self, out: SchedulerOutput) -> None:
        """Admit as the paged scheduler does; then, unless blocks ran short, each head in turn that displaces."""
        super()._admit_waiting(out)
        if not out.preempted:
            while out.budget > 0 and self.waiting and self._displace_for(self.waiting[0], out):
                pass

    def _displace_for(self, head: SequenceGroup, out: SchedulerOutput) -> bool:
        """Whether the head got in, displacing running groups."""
        victims = [g for g in self._displaceable(head) if g.num_preemptions < DISPLACEMENT_FLOOR]
        budget = self._budget_for(head, out.budget)
        if not victims or not budget or not self._would_fit(head, victims, budget):
            return False
        for victim in victims:
            if self._fits(head, budget):
                break
            self.preempt(victim, out)
            self.num_displacements += 1
        if self.waiting[0] is not head or not self._fits(head, budget):  # the queue's pick once the victims are back
            return False
        writes = self._plan_writes(head, budget)
        self._admit(head)
        self._run(head, writes, out)
        return True

    def _fits(self, head: SequenceGroup, budget: int) -> bool:
        return self.num_running_seqs + head.num_unfinished <= self.max_num_seqs and \
            self.adapters.can_acquire(head.lora_int_id) and \
            self._blocks_to_admit(head, self._plan_writes(head, budget)) <= self.block_manager.num_free_blocks

    def _would_fit(self, head: SequenceGroup, victims: list[SequenceGroup], budget: int) -> bool:
        """Seats and blocks for the head once the victims are gone: a block is freed if only victims hold it."""
        seats = self.num_running_seqs - sum(v.num_unfinished for v in victims) + head.num_unfinished
        freed = freed_blocks(self.block_manager, victims)
        needed = self._blocks_to_admit(head, self._plan_writes(head, budget))
        return seats <= self.max_num_seqs and needed <= self.block_manager.num_free_blocks + freed


class PriorityScheduler(DisplacingScheduler):
    """Admit by priority, then arrival; the running list is kept in the same order (`running_key`), so budget goes
    to the higher priorities first and the group preempted when blocks run out is the lowest priority (newest among
    equals). A waiting group that does not fit displaces strictly lower-priority running groups if that makes room."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.waiting = PriorityQueue()

    def _admit(self, group: SequenceGroup) -> None:
        super()._admit(group)
        self.running.sort(key=running_key)

    def _displaceable(self, head: SequenceGroup) -> list[SequenceGroup]:
        """Lower-priority running groups, lowest first."""
        return [g for g in reversed(self.running) if g.priority > head.priority]


def freed_blocks(bm: BlockManager, groups: list[SequenceGroup]) -> int:
    """Blocks that freeing these groups' tables would return to the pool."""
    held = Counter(b for g in groups for s in g.seqs if bm.has_table(s.seq_id) for b in bm.block_table(s.seq_id))
    return sum(bm.pool.ref_counts[b] == k for b, k in held.items())


class FairScheduler(DisplacingScheduler):
    """VTC: admit the earliest waiting group of the client served least; a client is charged its prompt when its
    request is first admitted and every token sampled for it. When blocks run out, the client served most loses its
    newest running group. Seats are shared too: a waiting client below its weighted share of the seats displaces
    the newest running groups of clients above theirs (else a light client waits for a heavy one's request to end,
    however little it was served). Between equal counters the client holding fewer seats goes first, and the step
    that admits the request of a client whose whole demand fits its share holds back for that step the prompts of
    clients whose demand exceeds theirs (its first token then costs about what it costs on an idle server), also when
    such a client, served more before it idled, comes back behind the queue's pick."""

    def __init__(self, *args: object, client_weights: dict[str, float] | None = None, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.waiting = self.vtc = VirtualTokenCounter(client_weights)
        self.vtc.tie_break = self._load
        self._held: set[str | None] = set()  # clients whose prompts wait during this step
        self._paced: set[str | None] = set()  # clients that compute PACED_PROMPT_TOKENS prompt tokens this step at most
        self._prompted: Counter[str | None] = Counter()  # the prompt tokens the paced clients computed this step
        self._lone: set[str | None] = set()  # clients with one request whose prompt starts small
        self._held_for: dict[int, SequenceGroup] = {}  # waiting groups a step held prompts for: once each
        self._admitted: list[SequenceGroup] = []  # this step's admissions, which it does not displace
        self._seat_counts: Counter[str | None] | None = None  # _seats(), until the running groups change
        self._steps = 0
        self._idle_step = 0  # the last step that began with nothing running
        self._last_served: dict[str | None, int] = {}  # the step each client was last served in

    def schedule(self) -> SchedulerOutput:
        self._admitted = []
        self._seats_changed()
        if not self.running:
            self._idle_step = self._steps
        self._held, self._paced, self._prompted = self._clients_to_hold(), self._clients_to_pace(), Counter()
        self._lone = self._slow_starters()
        self.vtc.deferred = frozenset(self._held)
        out = super().schedule()
        if out.is_empty and not out.preempted and (self._held or self._paced):  # the pick did not get in, and
            self._held, self._paced = set(), set()  # nothing else ran: never idle
            self.vtc.deferred = frozenset()
            self.block_manager.recorder.step -= 1
            out = super().schedule()
        self.vtc.deferred = frozenset()
        return out

    def _admit(self, group: SequenceGroup) -> None:
        super()._admit(group)
        self._admitted.append(group)
        self._seats_changed()
        if not group.num_preemptions:  # a preempted group's prompt was charged when it first ran
            self.vtc.charge(group.client, INPUT_WEIGHT * group.seqs[0].num_prompt_tokens)

    def _budget_for(self, group: SequenceGroup, budget: int) -> int:
        if group.is_decoding:
            return budget
        if group.client in self._held:
            return 0
        if group.client in self._paced:
            return min(budget, PACED_PROMPT_TOKENS - self._prompted[group.client])
        if group.client in self._lone:  # slow start: 64, 64, 128, 256, 256, ... tokens a step
            computed = group.seqs[0].num_computed_tokens
            return min(budget, LONE_PROMPT_TOKENS, max(PACED_PROMPT_TOKENS, computed))
        return budget

    def _slow_starters(self) -> set[str | None]:
        """The clients with a single request (its samples count once) whose prompt starts small: the only client
        about (running, waiting or served within the window: nobody knows yet who comes next), or one whose counter,
        with that prompt charged, is more than PACED_PROMPT_TOKENS above the least-served other client within its
        share of the seats (it would be paced from its next step on: `_served_ahead`)."""
        lone = {c for c, n in self._requests().items() if n == 1}
        about = self._seats().keys() | self.vtc.queues.keys() | self._recently_served()
        if not lone or len(about) == 1:
            return lone
        counter = self.vtc.counter
        within = sorted(about - self._over_share(about), key=counter)[:2]
        margin = INPUT_WEIGHT * PACED_PROMPT_TOKENS
        return {c for c in lone if (others := [o for o in within if o != c])
                and counter(c) + INPUT_WEIGHT * self._uncharged_prompt(c) > counter(others[0]) + margin}

    def _requests(self) -> Counter[str | None]:
        """Each client's requests running or waiting (a request's samples count once: one n=2 turn is one)."""
        requests = Counter(g.client for g in self.running)
        for client, queue in self.vtc.queues.items():
            requests[client] += len(queue)
        return requests

    def _over_share(self, clients: set[str | None]) -> set[str | None]:
        """Of `clients`, those whose running and waiting sequences exceed their share of the seats."""
        seats = self._seats()
        share = self._shares(seats, next(iter(seats), None))
        return {c for c in clients if seats[c] + self.vtc.num_waiting(c) > share(c)}

    def _uncharged_prompt(self, client: str | None) -> int:
        """The prompt tokens of `client`'s waiting request that its admission will charge (0 if it was admitted)."""
        queue = self.vtc.queues.get(client)
        if not queue or queue[0].num_preemptions:
            return 0
        return queue[0].seqs[0].num_prompt_tokens

    def _run(self, group: SequenceGroup, writes: Writes, out: SchedulerOutput) -> None:
        if group.client in self._paced and not group.is_decoding:
            self._prompted[group.client] += sum(w.end - w.start for _, w in writes)
        super()._run(group, writes, out)

    def preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        super().preempt(group, out)
        self._seats_changed()

    def finish(self, group: SequenceGroup) -> None:
        super().finish(group)
        self._seats_changed()

    def _seats_changed(self) -> None:
        self._seat_counts = None
        self.vtc.reorder()  # its tie-break counts seats

    def _seats(self) -> Counter[str | None]:
        """The seats each running client holds (read-only: kept until the running groups change)."""
        if self._seat_counts is None:
            self._seat_counts = Counter()
            for g in self.running:
                self._seat_counts[g.client] += g.num_unfinished
        return self._seat_counts

    def _shares(self, seats: Counter[str | None], head: str | None) -> Callable[[str | None], float]:
        """A client's share of the seats: max_num_seqs x its weight / the weights of the clients running (`seats`),
        the head's and its own."""
        weight = self.vtc.weight
        base = sum(weight(c) for c in seats) + (0.0 if head in seats else weight(head))

        def share(client: str | None) -> float:
            return self.max_num_seqs * weight(client) / (base + (0.0 if client in seats or client == head
                                                                  else weight(client)))
        return share

    def _load(self, client: str | None) -> tuple[float, float]:
        """The tie-break between equal counters: seats held, then requests waiting, per weight."""
        weight = self.vtc.weight(client)
        return self._seats()[client] / weight, len(self.vtc.queues.get(client, ())) / weight

    def _clients_to_hold(self) -> set[str | None]:
        """If the queue's pick is of a client whose running and waiting sequences all fit its share, and it can get
        a seat (free, or by a displacement), the other clients whose demand exceeds their share, or who were served
        far ahead (`_served_ahead`): their prompts wait for a step (decodes go on). Once per waiting group, so a pick
        that does not get in holds no one twice."""
        self._held_for = {k: g for k, g in self._held_for.items() if g in self.waiting}
        seats = self._seats()
        head = self._first_within_share(seats)
        if head is None or id(head) in self._held_for:
            return set()
        client, share = head.client, self._shares(seats, head.client)
        if self.num_running_seqs + head.num_unfinished > self.max_num_seqs and not any(
                g.num_preemptions < DISPLACEMENT_FLOOR for g in self._displaceable(head)):
            return set()
        self._held_for[id(head)] = head
        others = (set(seats) | set(self.vtc.queues)) - {client}
        over = {c for c in others if seats[c] + self.vtc.num_waiting(c) > share(c)}
        return over | self._served_ahead(others | {client}, others - over | {client}) - {client}

    def _first_within_share(self, seats: Counter[str | None]) -> SequenceGroup | None:
        """The first waiting group, least-served client first, of a client whose running and waiting sequences all
        fit its share: the queue's pick, or one behind a client over its share that a returning client's higher
        counter puts first (then the held client goes after it, `vtc.deferred`)."""
        weight, running = self.vtc.weight, sum(self.vtc.weight(c) for c in seats)
        for group in self._client_heads():
            c = group.client
            share = self.max_num_seqs * weight(c) / (running + (0.0 if c in seats else weight(c)))  # as _shares
            if seats[c] + self.vtc.num_waiting(c) <= share:
                return group
        return None

    def _client_heads(self) -> Iterator[SequenceGroup]:
        """Each waiting client's earliest group, the queue's pick first, then by counter."""
        if not self.waiting:
            return
        front = self.waiting[0]
        yield front
        rest = sorted((c for c in self.vtc.queues if c != front.client), key=self.vtc.counter)
        yield from (self.vtc.queues[c][0] for c in rest)

    def _clients_to_pace(self) -> set[str | None]:
        """While a client whose demand fits its share runs, or was served recently, the clients whose demand exceeds
        theirs: each computes at most PACED_PROMPT_TOKENS prompt tokens a step, so that no step computes a batch of
        their prompts at once (a light request arriving meanwhile would wait for all of it). In the first
        PACE_WINDOW_STEPS steps after the server was idle, every client with more than one request is paced: a light
        request may arrive with the first step of a batch. A client alone for the window is not paced. Whatever its
        seats, a client served well ahead of the least-served client about is paced too (`_served_ahead`)."""
        seats, recent = self._seats(), self._recently_served()
        present, starting = seats.keys() | recent, self._steps - self._idle_step < PACE_WINDOW_STEPS
        if len(present) < 2 and not self.vtc.queues.keys() - seats.keys() and not starting:
            return set()
        clients = present | self.vtc.queues.keys()
        over = self._over_share(clients)
        ahead = self._served_ahead(clients, clients - over)
        if present - over:
            return over | ahead
        if not starting:
            return ahead
        requests = self._requests()
        return ahead | {c for c in clients if requests[c] > 1}

    def _served_ahead(self, clients: set[str | None], within: set[str | None]) -> set[str | None]:
        """The clients whose counter is more than PACED_PROMPT_TOKENS prompt tokens above the least-served one's among
        those within their share of the seats: a client with long prompts sent one at a time holds a single seat, yet
        each prompt would fill whole steps while the others' requests wait for them. The least served is never paced
        (a lone chat turn stays whole), nor anyone when every client wants more than its share (throughput first)."""
        if len(clients) < 2 or not within:
            return set()
        counter = self.vtc.counter
        floor = min(map(counter, within)) + INPUT_WEIGHT * PACED_PROMPT_TOKENS
        return {c for c in clients if counter(c) > floor}

    def _recently_served(self) -> set[str | None]:
        """The clients served within the last PACE_WINDOW_STEPS steps (a light client thinking between requests)."""
        since = self._steps - PACE_WINDOW_STEPS
        if len(self._last_served) > 2 * max(self.max_num_seqs, 64):
            self._last_served = {c: t for c, t in self._last_served.items() if t >= since}
        return {c for c, t in self._last_served.items() if t >= since}

    def _displaceable(self, head: SequenceGroup) -> list[SequenceGroup]:
        """If the head's client holds fewer seats than its share (max_num_seqs x its weight / the weights of the
        clients running and the head's), the running groups of clients over their share and served at least as
        much (the head stays the queue's pick: a tie goes to the client holding fewer seats), most served first."""
        seats = self._seats()
        share = self._shares(seats, head.client)
        if seats[head.client] + head.num_unfinished > share(head.client):
            return []
        served, admitted = self.vtc.counter(head.client), {id(g) for g in self._admitted}
        over = [g for g in reversed(self.running) if id(g) not in admitted and self.vtc.counter(g.client) >= served
                and seats[g.client] > share(g.client)]
        return sorted(over, key=lambda g: -self.vtc.counter(g.client))  # stable: a client's newest first

    def _victim(self) -> SequenceGroup:
        return max(reversed(self.running), key=lambda g: self.vtc.counter(g.client))

    def commit(self, plan: SchedulerOutput) -> None:
        super().commit(plan)
        self._steps += 1
        for s in plan.scheduled:
            self._last_served[s.seq.params.client] = self._steps
            if s.samplers:
                self.vtc.charge(s.seq.params.client, OUTPUT_WEIGHT * len(s.samplers) * (1 + len(s.draft)))
