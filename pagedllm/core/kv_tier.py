"""The prefix cache's second tier as the block manager sees it (no torch, no files).

A full block is named in the tier by a chained digest of its whole prefix: blake2b over the parent's digest and the
block's tokens. It plays the part of `hash_block`'s chained hash but is strong and stable across processes (Python's
`hash` is 64 bits and may change between versions), so a file written yesterday names the same prefix today. The
block manager hands the tier the registered blocks its sequences let go (`offload`) and, when a prompt's prefix
leaves the pool's cache but the tier has the next blocks, asks for them back into fresh pool blocks (`restore`).
The engine's side (engine/kv_offload.py) copies the bytes and keeps the files.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Protocol

DIGEST_SIZE = 16


def chain_digest(parent: bytes, tokens: tuple[int, ...]) -> bytes:
    """A full block's name in the tier, from its parent's (b"" for a first block) and its tokens."""
    h = hashlib.blake2b(parent, digest_size=DIGEST_SIZE)
    h.update(struct.pack(f"<{len(tokens)}I", *tokens))
    return h.digest()


@dataclass(frozen=True)
class TierBlock:
    """A full block of a prompt that the pool does not hold and the tier does: restored at admission."""

    hash: int  # the prefix cache's chained hash (block_manager.hash_block), to register it in the pool
    tokens: tuple[int, ...]
    digest: bytes  # chain_digest: its name in the tier


class PrefixTier(Protocol):
    """What the block manager needs of a second tier. `restore` writes pool blocks: it must save whatever blocks
    `offload` handed it before it overwrites one (the pool may hand out a block it just let go)."""

    def contains(self, digest: bytes) -> bool:
        """Whether the tier holds this block, without reading it (called on every prefix lookup)."""
        ...

    def offload(self, blocks: list[tuple[int, bytes, tuple[int, ...]]]) -> None:
        """(pool block, digest, tokens) of registered blocks no sequence holds any more, head of a prefix first: keep
        their K/V, copied out before the pool reuses the blocks."""
        ...

    def restore(self, blocks: list[tuple[int, TierBlock]]) -> int:
        """Copy the tier's K/V into these (pool block, block) pairs, in order; how many of the first were restored
        (a read that fails stops there, and the rest is computed)."""
        ...
