"""The pool of KV-cache blocks, each sequence's block table, and the prefix cache.

Block ``b`` of the pool holds tokens ``[i * block_size, (i + 1) * block_size)`` of every
sequence whose table has ``b`` at index ``i``::

    table of seq A: [7, 2, 9]      tokens 0..15 in block 7, 16..31 in block 2, 32.. in 9
    slot of token t = table[t // block_size] * block_size + t % block_size

Prefix caching: once a block is full, it is registered under the key
``(key id of the previous block, its block_size token ids)``, so equal keys mean equal
prefixes, compared exactly (no hash collisions to fear). A new sequence walks its prompt
block by block through that map and shares every block it finds (reference counts).
A block whose count drops to 0 goes to the free queue but keeps its contents and key
until it is handed out again; the free queue is least-recently-freed first, and blocks
with no key (partial or duplicate) are handed out before cached ones::

    free queue:  [unkeyed ... | cached, least recently used ... most recently used]
                  ^ allocation takes from here, evicting a cached block's key if it must

Plain Python; the scheduler is the only caller.
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import islice
from typing import Sequence

__all__ = ["BlockManager"]

_ROOT = -1


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._ref = [0] * num_blocks
        self._tables: dict[str, list[int]] = {}
        self._num_keyed: dict[str, int] = {}  # leading blocks of each table already keyed
        # Prefix cache: key -> block, and the reverse; each key has an id its children use.
        self._cached: dict[tuple[int, tuple[int, ...]], int] = {}
        self._key_of: dict[int, tuple[int, tuple[int, ...]]] = {}
        self._key_id: dict[int, int] = {}
        self._next_key_id = 0
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    # --- introspection ------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (cached ones among them can still be reused or evicted)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def table(self, seq_id: str) -> list[int]:
        """The block table of ``seq_id`` (empty if it holds none). Do not mutate."""
        return self._tables.get(seq_id, [])

    # --- prefix cache -------------------------------------------------------------------------
    def match_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """Cached blocks holding the longest block-aligned prefix of ``token_ids``, cut so
        that at least one token is left to compute (its logits are needed). Read-only: the
        result is safe to pass to ``allocate`` in the same scheduling pass."""
        if not self.enable_prefix_caching:
            return []
        usable = (len(token_ids) - 1) // self.block_size
        blocks: list[int] = []
        parent = _ROOT
        cached, key_id = self._cached, self._key_id
        # zip over block_size references to one iterator yields the prompt's blocks as
        # tuples, built in C (a long cached prompt is walked on every admission).
        for tokens in islice(zip(*[iter(token_ids)] * self.block_size), usable):
            block = cached.get((parent, tokens))
            if block is None:
                break
            blocks.append(block)
            parent = key_id[block]
        return blocks

    def cache_full_blocks(self, seq_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        """Registers the blocks of ``seq_id`` that ``num_computed`` tokens have filled."""
        if not self.enable_prefix_caching:
            return
        done = self._num_keyed.get(seq_id, 0)
        full = num_computed // self.block_size
        if full <= done:
            return  # no block filled up since the last call: the common decode step
        table = self._tables.get(seq_id)
        if not table:
            return
        bs = self.block_size
        full = min(full, len(table))
        parent = self._key_id.get(table[done - 1], None) if done else _ROOT
        for i in range(done, full):
            block = table[i]
            if parent is None:  # the previous block has no key (a duplicate): stop chaining
                break
            if block in self._key_of:  # shared from the cache already
                parent = self._key_id[block]
                continue
            key = (parent, tuple(token_ids[i * bs : (i + 1) * bs]))
            if key in self._cached:  # same content computed by another sequence meanwhile
                parent = self._key_id[self._cached[key]]
                continue
            self._cached[key] = block
            self._key_of[block] = key
            self._key_id[block] = self._next_key_id
            self._next_key_id += 1
            parent = self._key_id[block]
        self._num_keyed[seq_id] = full

    # --- allocation ---------------------------------------------------------------------------
    def num_missing(self, seq_id: str, num_tokens: int, cached: Sequence[int] = ()) -> int:
        """Free-queue blocks ``allocate`` would take: new blocks, plus, for a new table,
        the cached hits that currently sit in the free queue."""
        table = self._tables.get(seq_id)
        if table:
            return max(0, self.blocks_for(num_tokens) - len(table))
        revived = sum(1 for b in cached if self._ref[b] == 0)
        return max(0, self.blocks_for(num_tokens) - len(cached)) + revived

    def can_allocate(self, seq_id: str, num_tokens: int, cached: Sequence[int] = ()) -> bool:
        """Whether ``seq_id``'s table can grow to cover its first ``num_tokens`` tokens
        (starting from the ``cached`` blocks of ``match_prefix`` for a new table)."""
        return self.num_missing(seq_id, num_tokens, cached) <= len(self._free)

    def allocate(self, seq_id: str, num_tokens: int, cached: Sequence[int] = ()) -> list[int]:
        """Grows ``seq_id``'s table to cover ``num_tokens`` tokens; a new table starts with
        the ``cached`` blocks (shared, reference-counted). Returns the table.

        Call ``can_allocate`` first: running out here is a scheduler bug.
        """
        missing = self.num_missing(seq_id, num_tokens, cached)
        if missing > len(self._free):
            raise RuntimeError(f"allocate({seq_id!r}, {num_tokens}) needs {missing} blocks, {len(self._free)} free")
        table = self._tables.get(seq_id)
        if table is None:
            table = self._tables[seq_id] = []
            for b in cached:
                if self._ref[b] == 0:
                    del self._free[b]
                self._ref[b] += 1
                table.append(b)
            self._num_keyed[seq_id] = len(cached)
        while len(table) < self.blocks_for(num_tokens):
            b, _ = self._free.popitem(last=False)
            self._evict(b)
            self._ref[b] = 1
            table.append(b)
        return table

    def record_query(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.num_queried_tokens += num_prompt_tokens
        self.num_hit_tokens += num_hit_tokens

    def _evict(self, block: int) -> None:
        key = self._key_of.pop(block, None)
        if key is not None:
            del self._cached[key]
            del self._key_id[block]

    def free(self, seq_id: str) -> None:
        """Drops ``seq_id``'s references; blocks no one holds return to the free queue,
        the last ones of the sequence first, so a prefix outlives its suffix."""
        table = self._tables.pop(seq_id, None)
        self._num_keyed.pop(seq_id, None)
        if not table:
            return
        for b in reversed(table):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None
                if b not in self._key_of:
                    self._free.move_to_end(b, last=False)
