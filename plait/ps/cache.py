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
    """Rows of one table, by global id (kept sorted)."""

    capacity: int
    dim: int
    ids: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    rows: torch.Tensor = field(init=False)
    version: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    uses: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    """Steps each row was read in."""
    last: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    """The last step each row was read in."""

    def __post_init__(self) -> None:
        self.rows = torch.empty(0, self.dim)

    def __len__(self) -> int:
        return len(self.ids)

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
        return self.rows[pos]

    def put(self, ids: torch.Tensor, rows: torch.Tensor, version: torch.Tensor, step: int) -> None:
        """Cache rows ``ids`` (as pulled at ``step``, read then), replacing older copies, then
        evict down to ``capacity``."""
        if self.capacity == 0 or len(ids) == 0:
            return
        known = torch.isin(self.ids, ids)
        uses = torch.ones(len(ids), dtype=torch.int64)
        if bool(known.any()):  # a row pulled again keeps its count
            old = torch.searchsorted(ids, self.ids[known])
            uses[old] += self.uses[known] - (self.last[known] == step).long()
        keep = ~known
        all_ids = torch.cat([self.ids[keep], ids])
        order = torch.argsort(all_ids)
        self.ids = all_ids[order]
        self.rows = torch.cat([self.rows[keep], rows])[order]
        self.version = torch.cat([self.version[keep], version])[order]
        self.uses = torch.cat([self.uses[keep], uses])[order]
        self.last = torch.cat([self.last[keep], torch.full((len(ids),), step)])[order]
        if len(self.ids) > self.capacity:
            self._evict()

    def _evict(self) -> None:
        # the hottest first: most steps read, then the most recent
        score = self.uses * (int(self.last.max()) + 2) + self.last
        kept = torch.topk(score, self.capacity).indices.sort().values
        self.ids, self.rows = self.ids[kept], self.rows[kept]
        self.version, self.uses, self.last = self.version[kept], self.uses[kept], self.last[kept]

    def clear(self) -> None:
        """Forget every row (the servers' rows were replaced: a checkpoint loaded)."""
        fresh = RowCache(self.capacity, self.dim)
        self.ids, self.rows, self.version = fresh.ids, fresh.rows, fresh.version
        self.uses, self.last = fresh.uses, fresh.last
