"""Prompt-lookup speculation: propose a sequence's next tokens from an earlier place where its last tokens appeared.

Where few sequences run, a decode step is bound by reading the weights, so verifying k proposed tokens costs little
more than computing one; greedy outputs, and prompts that quote themselves, repeat, so many proposals hold
(docs/performance-log.md). No draft model: the proposer is a dict per sequence, updated as its tokens grow.
How many tokens it proposes grows with what the sequence's last proposals kept (`window`): most proposals hold whole
or not at all, and a rejected token still costs a row of every matmul.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_NGRAM = 3  # the longest run of last tokens looked up (vLLM's prompt_lookup_max)
MAX_WINDOW = 64  # the window's ceiling; the engine's num_speculative_tokens caps what is proposed


@dataclass
class NgramIndex:
    """For every 1..MAX_NGRAM-gram of a sequence's tokens, the position just after its latest occurrence."""

    after: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 1  # n-grams ending before this position are in `after`
    # Tokens the next proposal may have: 1 at first, doubled when a proposal is accepted whole, else what was
    # accepted of it (at least 1), as TCP's window: a sequence that repeats itself earns long proposals, one that
    # does not wastes a row a step at most.
    window: int = 1

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the last 3 (else 2, else 1) tokens."""
        end = len(tokens)
        for stop in range(self.indexed, end):  # n-grams ending at tokens[stop - 1]; the last one stays out
            for n in range(1, min(MAX_NGRAM, stop) + 1):
                self.after[tuple(tokens[stop - n:stop])] = stop
        self.indexed = max(self.indexed, end)
        for n in range(min(MAX_NGRAM, end), 0, -1):
            at = self.after.get(tuple(tokens[end - n:end]))
            if at is not None:
                return tokens[at:at + k]
        return []

    def record(self, proposed: int, accepted: int) -> None:
        """The model kept `accepted` of the `proposed` tokens of this sequence's last proposal."""
        if proposed:
            self.window = min(MAX_WINDOW, 2 * self.window) if accepted == proposed else max(1, accepted)
