"""The pool of KV-cache blocks and each sequence's block table.

Block ``b`` of the pool holds tokens ``[i * block_size, (i + 1) * block_size)`` of the
sequence whose table has ``b`` at index ``i``::

    table of seq A: [7, 2, 9]      tokens 0..15 in block 7, 16..31 in block 2, 32.. in 9
    slot of token t = table[t // block_size] * block_size + t % block_size

Blocks are taken only as a sequence's computed tokens grow into them and all go back to
the free list the moment it finishes, is aborted or is preempted, so the waste is at most
one partly filled block per sequence. Plain Python; the scheduler is the only caller.
"""

from __future__ import annotations

from collections import deque

__all__ = ["BlockManager"]


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def table(self, seq_id: str) -> list[int]:
        """The block table of ``seq_id`` (empty if it holds none). Do not mutate."""
        return self._tables.get(seq_id, [])

    def num_missing(self, seq_id: str, num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(self._tables.get(seq_id, ())))

    def can_allocate(self, seq_id: str, num_tokens: int) -> bool:
        """Whether ``seq_id``'s table can grow to cover its first ``num_tokens`` tokens."""
        return self.num_missing(seq_id, num_tokens) <= len(self._free)

    def allocate(self, seq_id: str, num_tokens: int) -> list[int]:
        """Grows ``seq_id``'s table to cover ``num_tokens`` tokens; returns the table.

        Call ``can_allocate`` first: running out here is a scheduler bug.
        """
        missing = self.num_missing(seq_id, num_tokens)
        if missing > len(self._free):
            raise RuntimeError(f"allocate({seq_id!r}, {num_tokens}) needs {missing} blocks, {len(self._free)} free")
        table = self._tables.setdefault(seq_id, [])
        for _ in range(missing):
            table.append(self._free.popleft())
        return table

    def free(self, seq_id: str) -> None:
        """Returns all of ``seq_id``'s blocks to the pool (no-op if it holds none)."""
        table = self._tables.pop(seq_id, None)
        if table:
            self._free.extend(table)
