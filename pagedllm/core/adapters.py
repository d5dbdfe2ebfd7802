"""Which LoRA adapters are resident (hold a slot of the model's adapter stack), which running groups use them, and
where the next one goes: a free slot, else the least recently used idle one (S-LoRA's eviction). A resident adapter's
weights are counted in the KV block pool (S-LoRA's unified paging): it holds blocks of the pool while resident, and an
idle one gives them back when evicted. Plain data."""

from __future__ import annotations

from collections import Counter, OrderedDict

from pagedllm.core.block_manager import BlockManager

NO_ADAPTER = 0  # a request on the base model


class AdapterSlots:
    """`max_loras` slots; an adapter is resident from its first admitted group until evicted, idle while no running
    group uses it. Each load is queued (`take_loads`) with the blocks the adapter holds, for the model runner to write
    its weights into before the step's forward."""

    def __init__(self, max_loras: int = 0, block_manager: BlockManager | None = None) -> None:
        self.max_loras = max_loras
        self.block_manager = block_manager  # where resident adapters' blocks are taken from (None: not counted)
        self.sizes: dict[int, int] = {}  # blocks each registered adapter's weights count as
        self.slot_of: dict[int, int] = {}  # resident adapter -> its slot
        self.users: Counter[int] = Counter()  # running groups per resident adapter
        self.idle: OrderedDict[int, None] = OrderedDict()  # resident adapters no group uses, least recent first
        self.free_slots = list(range(max_loras - 1, -1, -1))  # popped from the end: slot 0 first
        self.loads: list[tuple[int, int, tuple[int, ...]]] = []  # (adapter, slot, its blocks) not yet handed over
        self.num_loads = 0
        self.num_evictions = 0

    def can_acquire(self, lora_int_id: int) -> bool:
        """The adapter is resident, or a slot is free or held by an idle adapter."""
        return lora_int_id == NO_ADAPTER or lora_int_id in self.slot_of or bool(self.free_slots or self.idle)

    def needs_load(self, lora_int_id: int) -> bool:
        return lora_int_id != NO_ADAPTER and lora_int_id not in self.slot_of

    def blocks_to_acquire(self, lora_int_id: int) -> int:
        """Free blocks that acquiring the adapter consumes: its own if it must be loaded, less those of the idle
        adapter whose slot it would take (none while a slot is free)."""
        if not self.needs_load(lora_int_id):
            return 0
        freed = self.sizes.get(next(iter(self.idle)), 0) if self.idle and not self.free_slots else 0
        return self.sizes.get(lora_int_id, 0) - freed

    def acquire(self, lora_int_id: int) -> None:
        """A group with this adapter starts running: make it resident (evicting an idle one if no slot is free)."""
        if lora_int_id == NO_ADAPTER:
            return
        if lora_int_id not in self.slot_of:
            slot = self.free_slots.pop() if self.free_slots else self.evict_idle()
            self.slot_of[lora_int_id] = slot
            blocks: tuple[int, ...] = ()
            if self.block_manager is not None:
                self.block_manager.hold_adapter(lora_int_id, self.sizes.get(lora_int_id, 0))
                blocks = tuple(self.block_manager.adapter_blocks[lora_int_id])
            self.loads.append((lora_int_id, slot, blocks))
            self.num_loads += 1
        self.idle.pop(lora_int_id, None)
        self.users[lora_int_id] += 1

    def release(self, lora_int_id: int) -> None:
        """A group with this adapter stopped running (finished or preempted); the adapter stays resident, idle."""
        if lora_int_id == NO_ADAPTER:
            return
        self.users[lora_int_id] -= 1
        if not self.users[lora_int_id]:
            del self.users[lora_int_id]
            self.idle[lora_int_id] = None

    def evict_idle(self) -> int:
        """Drop the least recently used idle adapter; its slot."""
        lora_int_id, _ = self.idle.popitem(last=False)
        self.num_evictions += 1
        if self.block_manager is not None:
            self.block_manager.release_adapter(lora_int_id)
        return self.slot_of.pop(lora_int_id)

    def evict_idle_except(self, keep: int) -> bool:
        """Evict the least recently used idle adapter other than `keep` (its slot freed, its blocks back in the
        pool), for blocks the KV cache needs; False if there is none."""
        if not self.idle or list(self.idle) == [keep]:
            return False
        if next(iter(self.idle)) == keep:
            self.idle.move_to_end(keep)
        self.free_slots.append(self.evict_idle())
        return True

    def forget(self, lora_int_id: int) -> bool:
        """Drop an adapter that no running group uses (unloaded); False if one does."""
        if lora_int_id in self.users:
            return False
        if lora_int_id in self.idle:
            del self.idle[lora_int_id]
            self.free_slots.append(self.slot_of.pop(lora_int_id))
            if self.block_manager is not None:
                self.block_manager.release_adapter(lora_int_id)
        self.sizes.pop(lora_int_id, None)
        return True

    def take_loads(self) -> list[tuple[int, int, tuple[int, ...]]]:
        loads, self.loads = self.loads, []
        return loads

    def check(self) -> None:
        assert len(self.slot_of) + len(self.free_slots) == self.max_loras, "a slot is lost or taken twice"
        assert set(self.idle) | set(self.users) == set(self.slot_of), "a resident adapter is neither idle nor used"
        assert not set(self.idle) & set(self.users), "an idle adapter has users"
        if self.block_manager is not None:
            assert set(self.block_manager.adapter_blocks) == set(self.slot_of), "a resident adapter holds no blocks"
