"""Prompt-lookup speculation: propose a sequence's next tokens from an earlier place where its last tokens appeared.

Where few sequences run, a decode step is bound by reading the weights, so verifying k proposed tokens costs little
more than computing one; greedy outputs, and prompts that quote themselves, repeat, so many proposals hold
(docs/performance-log.md). No draft model: the proposer is a dict per sequence, updated as its tokens grow.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_NGRAM = 3  # the longest run of last tokens looked up (vLLM's prompt_lookup_max)


@dataclass
class NgramIndex:
    """For every 1..MAX_NGRAM-gram of a sequence's tokens, the position just after its latest occurrence."""

    after: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 1  # n-grams ending before this position are in `after`

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
