"""A worker's cache of a server-held table's hottest rows (``vocab_cache_size``).

Each cached row keeps the version the server stamped it with when it was pulled: the number
of steps whose pushes from every worker the row's server had applied. A row of version ``v``
may serve a read at step ``t`` while ``v >= t - max_staleness``: the bound a pull at step
``t`` waits for anyway (:mod:`plait.ps.server`). So the cache never makes training staler
than the job's ``ps_mode`` allows:

- ``"sync"`` (staleness 0): a row read at step ``t`` serves the rest of step ``t`` (the
  micro-batches of gradient accumulation, a table looked up twice) and is pulled again at
  ``t + 1``, when the step's update has changed it;
- ``"async"`` with ``max_staleness=k``: a row serves up to ``k`` more steps before it is
  pulled again; hot rows, read every step, are pulled about once every ``k + 1`` steps.

The cache is write-through: every step's gradients are pushed to the servers, so no cached row
is ever newer than its server's, and an evicted row has nothing to write back. When more than
``capacity`` rows are cached, the ones read in the fewest steps go (ties: the least recently
read), so the hottest rows stay.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["RowCache"]


@dataclass
class RowCache:
    """Rows of one table, by global id. The rows sit in a buffer of ``capacity`` slots
    allocated once (a put writes only the rows it brings); the ids, kept sorted for lookups,
    point to their slots."""

    capacity: int
    dim: int
    ids: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    slot: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    """Each cached id's slot in :attr:`buffer`."""
    version: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    uses: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    """Steps each row was read in."""
    last: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    """The last step each row was read in."""
    buffer: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.buffer = torch.empty(self.capacity, self.dim)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def rows(self) -> torch.Tensor:
        """The cached rows, in id order."""
        return self.buffer[self.slot]

    def find(self, ids: torch.Tensor, fresh_from: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For ascending unique ``ids``: which are cached with a version ``>= fresh_from``
        (a mask) and their positions in the cache."""
        if len(self.ids) == 0:
            return torch.zeros(len(ids), dtype=torch.bool), torch.zeros(len(ids), dtype=torch.long)
        pos = torch.searchsorted(self.ids, ids).clamp(max=len(self.ids) - 1)
        hit = (self.ids[pos] == ids) & (self.version[pos] >= fresh_from)
        return hit, pos

    def read(self, pos: torch.Tensor, step: int) -> torch.Tensor:
        """Rows at ``pos`` (from :meth:`find`), counted as read at ``step``."""
        first = self.last[pos] != step
        self.uses[pos[first]] += 1
        self.last[pos] = step
        return self.buffer[self.slot[pos]]

    def put(self, ids: torch.Tensor, rows: torch.Tensor, version: torch.Tensor, step: int) -> None:
        """Cache rows ``ids`` (ascending unique, as pulled at ``step`` and read then): a row
        cached already is overwritten in its slot and keeps its count; new rows take free
        slots, the coldest rows evicted to make room."""
        if self.capacity == 0 or len(ids) == 0:
            return
        if len(ids) > self.capacity:  # only the last capacity rows can stay
            ids, rows, version = (
                ids[-self.capacity :],
                rows[-self.capacity :],
                version[-self.capacity :],
            )
        pos = torch.searchsorted(self.ids, ids).clamp(max=max(len(self.ids) - 1, 0))
        known = (self.ids[pos] == ids) if len(self.ids) else torch.zeros(len(ids), dtype=torch.bool)
        at = pos[known]
        self.buffer[self.slot[at]] = rows[known]
        self.version[at] = version[known]
        self.uses[at] += (self.last[at] != step).long()
        self.last[at] = step
        fresh = ~known
        if not bool(fresh.any()):
            return
        slots = self._free_slots(int(fresh.sum()), keep=at)
        self.buffer[slots] = rows[fresh]
        n = int(fresh.sum())
        merged = torch.cat([self.ids, ids[fresh]])
        order = torch.argsort(merged)
        self.ids = merged[order]
        self.slot = torch.cat([self.slot, slots])[order]
        self.version = torch.cat([self.version, version[fresh]])[order]
        self.uses = torch.cat([self.uses, torch.ones(n, dtype=torch.int64)])[order]
        self.last = torch.cat([self.last, torch.full((n,), step)])[order]

    def _free_slots(self, n: int, keep: torch.Tensor) -> torch.Tensor:
        """``n`` slots for new rows: unused ones first, then those of the coldest rows (the
        fewest steps read, then the least recently), never one of ``keep``'s positions."""
        used = len(self.ids)
        spare = min(n, self.capacity - used)
        taken = torch.zeros(self.capacity, dtype=torch.bool)
        taken[self.slot] = True
        slots = torch.nonzero(~taken).flatten()[:spare]
        evict = n - spare
        if evict == 0:
            return slots
        score = self.uses * (int(self.last.max()) + 2) + self.last
        score[keep] = torch.iinfo(torch.int64).max  # refreshed just now: stay
        gone = torch.topk(score, evict, largest=False).indices
        stay = torch.ones(used, dtype=torch.bool)
        stay[gone] = False
        freed = self.slot[gone]
        self.ids, self.slot = self.ids[stay], self.slot[stay]
        self.version, self.uses, self.last = self.version[stay], self.uses[stay], self.last[stay]
        return torch.cat([slots, freed])

    def clear(self) -> None:
        """Forget every row (the servers' rows were replaced: a checkpoint loaded)."""
        empty = torch.empty(0, dtype=torch.int64)
        self.ids, self.slot, self.version = empty, empty.clone(), empty.clone()
        self.uses, self.last = empty.clone(), empty.clone()
