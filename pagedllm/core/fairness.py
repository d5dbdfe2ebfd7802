"""The Virtual Token Counter (Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024, Algorithm 2):
each client's counter holds the weighted tokens it has been served; the next request admitted is the earliest of the
waiting client with the smallest counter, so no backlogged client falls more than a bounded amount of service behind
another, and the server still never idles while anyone waits (work-conserving)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

from pagedllm.core.sequence import SequenceGroup

# The paper's w_p and w_q: an output token costs a decode step, a prompt token a share of a prefill
INPUT_WEIGHT = 1.0
OUTPUT_WEIGHT = 2.0

Client = str | None
TieBreak = Callable[[Client], tuple[float, float]]
KEPT_COUNTERS = 4096  # idle clients' counters kept before those at or below the lift are dropped


class VirtualTokenCounter:
    """The fair scheduler's waiting queue: one FIFO per client, the front is the earliest request of the waiting
    client served least. A client's share is its weight (default 1): its counter grows by tokens / weight."""

    def __init__(self, weights: dict[str, float] | None = None) -> None:
        self.weights = dict(weights or {})
        self._tie_break: TieBreak | None = None
        self.counters: dict[Client, float] = {}
        self.queues: dict[Client, deque[SequenceGroup]] = {}  # clients with a waiting group, in the order they came
        self.last_left = 0.0  # the counter of the last client whose queue emptied: the lift when no one waits
        self._len = 0
        self._prune_at = KEPT_COUNTERS
        self._front: tuple[Client] | None = None  # front_client(), until a counter, a queue or the tie-break changes
        self._deferred: frozenset[Client] = frozenset()

    @property
    def tie_break(self) -> TieBreak | None:
        """Orders clients whose counters tie (the least first; VTC leaves the order open), then the one waiting
        longest. The fair scheduler gives the seats a client holds, then the requests it has waiting (both per
        weight): a client lifted to another's counter on its return goes first, instead of waiting a step for the
        other to be charged."""
        return self._tie_break

    @tie_break.setter
    def tie_break(self, key: TieBreak | None) -> None:
        self._tie_break, self._front = key, None

    @property
    def deferred(self) -> frozenset[Client]:
        """Clients that go after every other waiting client for now (the fair scheduler's held ones, for a step)."""
        return self._deferred

    @deferred.setter
    def deferred(self, clients: frozenset[Client]) -> None:
        self._deferred, self._front = clients, None

    def counter(self, client: Client) -> float:
        return self.counters.get(client, 0.0)

    def weight(self, client: Client) -> float:
        return self.weights.get(client or "", 1.0)

    def charge(self, client: Client, tokens: float) -> None:
        """Count weighted tokens served to the client."""
        self.counters[client] = self.counter(client) + tokens / self.weight(client)
        self._front = None

    def reorder(self) -> None:
        """What `tie_break` says has changed."""
        self._front = None

    # ---- the queue (core/scheduler.py's WaitingQueue) ----------------------------------------------------------
    def append(self, group: SequenceGroup) -> None:
        """A new request. A client with nothing waiting is lifted to the least counter of those waiting (or the last
        to leave, if none waits): idling earns no credit to spend later in a burst."""
        client = group.client
        if client not in self.queues:
            floor = min((self.counter(c) for c in self.queues), default=self.last_left)
            self.counters[client] = max(self.counter(client), floor)
            self.queues[client] = deque()
            if len(self.counters) > self._prune_at:
                self._forget_idle(floor)
        self.queues[client].append(group)
        self._len += 1
        self._front = None

    def appendleft(self, group: SequenceGroup) -> None:
        """A preempted request: first of its client's again, with no lift (it was being served)."""
        self.queues.setdefault(group.client, deque()).appendleft(group)
        self._len += 1
        self._front = None

    def front_client(self) -> Client:
        """The waiting client with the smallest counter, not deferred if any is not; among equals, the least by
        `tie_break`, then the one waiting longest."""
        if self._front is None:
            clients = [c for c in self.queues if c not in self._deferred] or list(self.queues)
            least = min(clients, key=self.counter)
            tied = [c for c in clients if self.counter(c) == self.counter(least)] if self.tie_break else []
            self._front = (min(tied, key=self.tie_break) if len(tied) > 1 else least,)
        return self._front[0]

    def num_waiting(self, client: Client) -> int:
        """The sequences the client's waiting requests will run."""
        return sum(g.num_unfinished for g in self.queues.get(client, ()))

    def __getitem__(self, index: int) -> SequenceGroup:
        if index != 0 or not self.queues:
            raise IndexError("the fair queue shows only its front")
        return self.queues[self.front_client()][0]

    def popleft(self) -> SequenceGroup:
        client = self.front_client()
        group = self.queues[client].popleft()
        self._forget_if_empty(client)
        return group

    def remove(self, group: SequenceGroup) -> None:
        self.queues[group.client].remove(group)
        self._forget_if_empty(group.client)

    def _forget_idle(self, floor: float) -> None:
        """Drop the counters of clients with nothing waiting that a lift would raise to `floor` anyway, so that a
        stream of new client names holds no memory (a running client dropped restarts from 0, then is lifted)."""
        self.counters = {c: v for c, v in self.counters.items() if c in self.queues or v > floor}
        self._prune_at = max(KEPT_COUNTERS, 2 * len(self.counters))

    def _forget_if_empty(self, client: Client) -> None:
        self._len -= 1
        self._front = None
        if not self.queues[client]:
            del self.queues[client]
            self.last_left = self.counter(client)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[SequenceGroup]:
        """Least-served client first (the front's order), each client's requests in order."""
        tie = self.tie_break or (lambda c: (0.0, 0.0))
        for client in sorted(self.queues, key=lambda c: (self.counter(c), tie(c))):
            yield from self.queues[client]

    def __contains__(self, group: object) -> bool:
        return isinstance(group, SequenceGroup) and group in self.queues.get(group.client, ())


def max_service_gap(samples: list[tuple[dict[Client, float], set[Client]]]) -> float:
    """The most one client's service gained on another's over a stretch when both were backlogged: the quantity
    VTC bounds. `samples` are, in time order, each client's service so far and the clients that had a request
    waiting since the sample before (a stretch starts from the sample before its first)."""
    clients = sorted({c for served, _ in samples for c in served}, key=str)
    gap = 0.0
    for i, f in enumerate(clients):
        for g in clients[i + 1:]:
            leads = [served.get(f, 0.0) - served.get(g, 0.0) for served, _ in samples]
            low = high = None  # the range of f's lead over g during the current stretch
            for k, (_, backlogged) in enumerate(samples):
                if f not in backlogged or g not in backlogged:
                    low = high = None
                    continue
                if low is None or high is None:
                    low = high = leads[k - 1] if k else 0.0
                low, high = min(low, leads[k]), max(high, leads[k])
                gap = max(gap, high - low)
    return gap
