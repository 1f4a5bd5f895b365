"""Dataset sharding: each data-parallel rank loads its own part of every global batch.

Problem. A job trains on a sequence of *global batches*. With ``n`` data-parallel ranks, each
rank should read only ``global_batch_size / n`` samples of every global batch, the ranks'
parts should be disjoint and together form the global batch, ranks of one model-parallel group
(same data-parallel coordinate) should read the same samples, and the whole sequence should be
reproducible from ``(seed, epoch, step)`` so that a run can stop and resume exactly.
(MindSpore section 13: ``dataset_strategy="data_parallel"`` with ``num_shards``/``shard_id``.)

Guarantees, with ``B = global_batch_size``, ``L = dataset_len`` and ``n = dp_size``:

1. Epoch ``e`` orders the samples by ``perm_e``, a Fisher-Yates shuffle of ``0..L-1`` driven
   by ``random.Random(seed + e).random()`` (or ``0..L-1`` without shuffle). Global batch ``s``
   of epoch ``e`` is ``perm_e[s*B : (s+1)*B]``: the same for every rank and every ``n``.
   -> :meth:`ShardedSampler.permutation`, :meth:`ShardedSampler.global_batch`
2. Rank ``r`` gets the contiguous ``r``-th slice ``[r*B/n : (r+1)*B/n]`` of it, so the slices
   are disjoint, cover the global batch, and concatenated in rank order give it back in order:
   training on them equals single-device training on the global batch.
   -> :meth:`ShardedSampler.local_batch`
3. ``drop_last=True`` drops the last ``L mod B`` samples of each epoch; ``drop_last=False``
   completes the last global batch from the start of ``perm_e`` (every batch has ``B`` samples).
4. The position is ``(epoch, step)``; ``state_dict()``/``load_state_dict()`` restore it and the
   remaining batches are identical. The position does not depend on ``n``: a run may resume on
   another number of data-parallel ranks.

Per-input strategies (``dataset_strategy`` tuples, MindSpore's ``((1, 1, 1, 4), (1,))``) cut
inputs along other dims too; :func:`input_layouts` resolves them to :class:`TensorLayout`\\ s and
:func:`slice_batch` cuts a global batch to one rank's piece. :class:`InputSlicer` does the same
inside a :class:`ShardedLoader`, so that a rank loads only the samples of its dim-0 piece.

What this module is not: it does not move data between ranks and never touches
``torch.distributed``; every rank computes its own part from the same deterministic rules.
Index arithmetic is plain Python, not torch: under simulated ranks (``LocalTensorMode``) torch
ops return per-rank tensors and ``torch.randperm`` draws a different permutation per rank.
Python guarantees the ``random()`` sequence of a seeded ``random.Random`` across versions, so
the permutation does not change with the Python or torch version either.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from plait._compat import simulated_ranks, tree_leaves, tree_map
from plait.errors import ConfigError, LayoutError, ShardingError
from plait.layout import TensorLayout, resolve_tensor_strategy
from plait.mesh import MeshSpec

if TYPE_CHECKING:
    from plait.comm.dtensor import DeviceMesh
    from plait.config import ParallelConfig
from plait.rules.common import to_mesh

__all__ = [
    "InputSlicer",
    "ShardedLoader",
    "ShardedSampler",
    "input_layouts",
    "planned_piece",
    "slice_batch",
    "split_micro_batches",
]

logger = logging.getLogger(__name__)

InputStrategy = Sequence[int] | TensorLayout
DatasetStrategy = str | Sequence[InputStrategy]
Batch = torch.Tensor | Sequence[torch.Tensor]

# Settings that fix the sequence of global batches; a saved position is only valid with them.
_SEQUENCE_KEYS = ("dataset_len", "global_batch_size", "seed", "shuffle", "drop_last")


def _check_int(name: str, value: object, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"{name}={value!r} is not allowed; use an integer >= {low}")


class ShardedSampler(Sampler[int]):
    """This data-parallel rank's sample indices, global batch after global batch.

    Iterating yields the indices of ``local_batch_size`` samples per global batch, from the
    current position to the end of the epoch; the position then moves to the next epoch.

    Args:
        dataset_len: number of samples in the dataset.
        global_batch_size: samples per global batch (all data-parallel ranks together).
        dp_size: number of data-parallel ranks.
        dp_rank: this rank's data-parallel coordinate, ``0 <= dp_rank < dp_size``.
        shuffle: draw a fresh permutation each epoch; otherwise use dataset order.
        seed: permutation of epoch ``e`` is seeded with ``seed + e``; equal on every rank.
        drop_last: drop the incomplete last global batch, or complete it from the epoch's start.

    Raises:
        ConfigError: a count is not a positive integer, ``dp_rank`` is out of range,
            ``global_batch_size`` is not divisible by ``dp_size``, or the dataset is smaller
            than one global batch with ``drop_last=True``.

    Example:
        >>> s = ShardedSampler(8, global_batch_size=4, dp_size=2, dp_rank=1, shuffle=False)
        >>> list(s)
        [2, 3, 6, 7]
    """

    def __init__(
        self,
        dataset_len: int,
        *,
        global_batch_size: int,
        dp_size: int = 1,
        dp_rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ) -> None:
        _validate_sampler(dataset_len, global_batch_size, dp_size, dp_rank, drop_last)
        _check_int("seed", seed, 0)
        self.dataset_len = dataset_len
        self.global_batch_size = global_batch_size
        self.dp_size = dp_size
        self.dp_rank = dp_rank
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self.step = 0

    @property
    def local_batch_size(self) -> int:
        """Samples this rank gets of each global batch (``global_batch_size / dp_size``)."""
        return self.global_batch_size // self.dp_size

    @property
    def num_batches(self) -> int:
        """Global batches per epoch."""
        if self.drop_last:
            return self.dataset_len // self.global_batch_size
        return math.ceil(self.dataset_len / self.global_batch_size)

    def __len__(self) -> int:
        return self.num_batches * self.local_batch_size

    def permutation(self, epoch: int) -> list[int]:
        """The order of the samples in ``epoch`` (guarantee 1)."""
        order = list(range(self.dataset_len))
        if self.shuffle:
            rng = random.Random(self.seed + epoch)
            for i in range(len(order) - 1, 0, -1):
                j = int(rng.random() * (i + 1))
                order[i], order[j] = order[j], order[i]
        return order

    def global_batch(self, epoch: int, step: int) -> list[int]:
        """Indices of global batch ``step`` of ``epoch``, all ranks' slices in rank order."""
        return self._global_batch(self.permutation(epoch), step)

    def local_batch(self, epoch: int, step: int) -> list[int]:
        """This rank's slice of global batch ``step`` of ``epoch`` (guarantee 2)."""
        return self._local_slice(self.global_batch(epoch, step))

    def local_batches(self, epoch: int, start: int = 0) -> Iterator[list[int]]:
        """This rank's slices of global batches ``start, start + 1, ...`` of ``epoch``."""
        perm = self.permutation(epoch)
        for step in range(start, self.num_batches):
            yield self._local_slice(self._global_batch(perm, step))

    def _global_batch(self, perm: list[int], step: int) -> list[int]:
        if not 0 <= step < self.num_batches:
            raise ConfigError(
                f"step={step} is out of range: an epoch has {self.num_batches} global batches "
                f"of {self.global_batch_size} samples; use 0 <= step < {self.num_batches}"
            )
        begin = step * self.global_batch_size
        end = begin + self.global_batch_size
        return [perm[i % self.dataset_len] for i in range(begin, end)]

    def _local_slice(self, global_batch: list[int]) -> list[int]:
        begin = self.dp_rank * self.local_batch_size
        return global_batch[begin : begin + self.local_batch_size]

    def __iter__(self) -> Iterator[int]:
        epoch = self.epoch
        for batch in self.local_batches(epoch, self.step):
            yield from batch[:-1]
            # Count the batch as handed out with its last index, before the caller resumes us.
            self.step += 1
            yield batch[-1]
        self.epoch, self.step = epoch + 1, 0

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first batch; the current epoch keeps its position.

        So a loop that calls ``set_epoch(e)`` at the top of each epoch also resumes correctly
        after :meth:`load_state_dict` restored a position inside epoch ``e``.
        """
        _check_int("epoch", epoch, 0)
        if epoch != self.epoch:
            self.epoch, self.step = epoch, 0

    def state_dict(self) -> dict[str, Any]:
        """The position ``(epoch, step)`` and the settings that fix the batch sequence."""
        state = {key: getattr(self, key) for key in _SEQUENCE_KEYS}
        state.update(epoch=self.epoch, step=self.step, dp_size=self.dp_size)
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a position saved by :meth:`state_dict` (possibly on another ``dp_size``).

        Raises:
            ConfigError: the saved sequence settings differ from this sampler's, or the
                position is out of range.
        """
        for key in _SEQUENCE_KEYS:
            if key in state and state[key] != getattr(self, key):
                raise ConfigError(
                    f"cannot resume: the saved state has {key}={state[key]!r} but this sampler "
                    f"has {key}={getattr(self, key)!r}; the batch sequence would differ, so "
                    f"build the sampler with {key}={state[key]!r}"
                )
        epoch, step = state["epoch"], state["step"]
        _check_int("epoch", epoch, 0)
        _check_int("step", step, 0)
        if step > self.num_batches:
            raise ConfigError(
                f"cannot resume at step={step}: an epoch has only {self.num_batches} global "
                "batches; pass a state saved by a sampler with the same settings"
            )
        self.epoch, self.step = epoch, step


def _validate_sampler(
    dataset_len: int, global_batch_size: int, dp_size: int, dp_rank: int, drop_last: bool
) -> None:
    _check_int("dataset_len", dataset_len, 1)
    _check_int("global_batch_size", global_batch_size, 1)
    _check_int("dp_size", dp_size, 1)
    _check_int("dp_rank", dp_rank, 0)
    if dp_rank >= dp_size:
        raise ConfigError(
            f"dp_rank={dp_rank} is out of range for dp_size={dp_size}; a data-parallel rank is "
            f"between 0 and {dp_size - 1}"
        )
    if global_batch_size % dp_size:
        raise ConfigError(
            f"global_batch_size={global_batch_size} does not divide into dp_size={dp_size} "
            f"equal slices; use a global batch size that is a multiple of {dp_size}"
        )
    if drop_last and dataset_len < global_batch_size:
        raise ConfigError(
            f"dataset_len={dataset_len} is smaller than global_batch_size={global_batch_size}, "
            "so drop_last=True leaves no batch; use a smaller global batch, more data, or "
            "drop_last=False (which repeats samples to fill the batch)"
        )


# Per-input strategies -------------------------------------------------------------------------


def _dp_size(mesh: MeshSpec, dp_axis: str) -> int:
    return mesh.axis_size(dp_axis) if dp_axis in mesh.axis_names else 1


def _sub_mesh(mesh: MeshSpec, skip: str) -> MeshSpec:
    free = [a for a in mesh.axis_names if a != skip]
    return MeshSpec(tuple(free), tuple(mesh.axis_size(a) for a in free))


def _resolve_tuple(
    strategy: Sequence[int], shape: Sequence[int], mesh: MeshSpec, dp_axis: str, where: str
) -> TensorLayout:
    """Dim 0 split dp-size ways takes the dp axis; other splits take free axes from the right."""
    strategy = tuple(strategy)
    if len(strategy) != len(shape):
        raise LayoutError(
            f"{where}: strategy {strategy!r} has {len(strategy)} entries but the input has "
            f"{len(shape)} dims (shape {tuple(shape)!r}); give one split count per dim"
        )
    dp = _dp_size(mesh, dp_axis)
    if dp > 1 and strategy and strategy[0] == dp:
        rest = resolve_tensor_strategy((1, *strategy[1:]), _sub_mesh(mesh, dp_axis), where)
        return TensorLayout(mesh, ((dp_axis,), *rest.dims[1:]))
    return TensorLayout(mesh, resolve_tensor_strategy(strategy, mesh, where).dims)


def _resolve_one(
    strategy: object, shape: Sequence[int], mesh: MeshSpec, dp_axis: str, where: str
) -> TensorLayout:
    if isinstance(strategy, TensorLayout):
        layout = to_mesh(strategy, mesh, where)
        if layout.partial:
            raise LayoutError(
                f"{where}: layout {layout.describe()} holds a partial sum; an input is data, "
                "not a pending reduction: drop the partial axes"
            )
    elif isinstance(strategy, Sequence) and all(isinstance(n, int) for n in strategy):
        layout = _resolve_tuple(strategy, shape, mesh, dp_axis, where)
    else:
        raise LayoutError(
            f"{where}: strategy {strategy!r} is neither a tuple of split counts nor a "
            "TensorLayout; write e.g. (2, 1) or plait.Layout(...)('dp', 'None')"
        )
    layout.check_shape(shape, where)
    return layout


def input_layouts(
    strategies: DatasetStrategy,
    shapes: Sequence[Sequence[int]],
    mesh: MeshSpec,
    *,
    dp_axis: str = "dp",
) -> tuple[TensorLayout, ...]:
    """The layout of the piece of each input that one rank holds, on ``mesh``.

    Args:
        strategies: ``"data_parallel"`` (dim 0 across ``dp_axis``), ``"full_batch"`` (every
            rank holds every input whole), or one strategy per input: a tuple of split counts
            per dim, or a :class:`TensorLayout` from :class:`plait.Layout`. In a tuple, a dim-0
            split equal to the size of ``dp_axis`` takes that axis and the other splits take
            the remaining axes from the right; otherwise all splits take axes from the right
            (MindSpore's rule).
        shapes: the global shape of each input.
        mesh: the job's mesh.
        dp_axis: the data-parallel axis.

    Raises:
        LayoutError, ShardingError: a strategy does not fit its input or the mesh, or an input
            dim does not divide evenly.

    Example:
        >>> mesh = MeshSpec.from_dict({"dp": 2, "tp": 2})
        >>> [l.describe() for l in input_layouts(((2, 2), (2,)), [(4, 6), (4,)], mesh)]
        ['[dp, tp]', '[dp]']
    """
    if strategies == "data_parallel":
        dp = (dp_axis,) if _dp_size(mesh, dp_axis) > 1 else ()
        layouts = [TensorLayout(mesh, (dp,) + ((),) * (len(s) - 1)) for s in shapes]
        for i, (layout, shape) in enumerate(zip(layouts, shapes, strict=True)):
            layout.check_shape(shape, f"dataset_strategy 'data_parallel', input {i}")
        return tuple(layouts)
    if strategies == "full_batch":
        return tuple(TensorLayout.replicated(mesh, len(s)) for s in shapes)
    if isinstance(strategies, str) or not isinstance(strategies, Sequence):
        raise LayoutError(
            f"dataset_strategy={strategies!r} is not allowed; use 'data_parallel', "
            "'full_batch' or a tuple with one strategy per input"
        )
    if len(strategies) != len(shapes):
        raise LayoutError(
            f"dataset_strategy gives {len(strategies)} strategies for a batch of {len(shapes)} "
            f"inputs (shapes {[tuple(s) for s in shapes]!r}); give one strategy per input"
        )
    return tuple(
        _resolve_one(s, shape, mesh, dp_axis, f"dataset_strategy input {i}")
        for i, (s, shape) in enumerate(zip(strategies, shapes, strict=True))
    )


def _as_inputs(batch: Batch) -> tuple[list[torch.Tensor], Callable[[list[Any]], Any]]:
    """The batch's tensors, and how to rebuild a batch of the same kind from new ones."""
    if isinstance(batch, torch.Tensor):
        return [batch], lambda xs: xs[0]
    if isinstance(batch, list | tuple) and all(isinstance(x, torch.Tensor) for x in batch):
        return list(batch), type(batch)
    raise LayoutError(
        f"a batch of type {type(batch).__name__} cannot be sliced by input strategies; pass a "
        "tensor or a tuple/list of tensors, one per strategy"
    )


def _cut(x: torch.Tensor, layout: TensorLayout, rank: int, first_dim: int) -> torch.Tensor:
    for dim in range(first_dim, layout.ndim):
        pieces = layout.splits()[dim]
        if pieces > 1:
            x = x.chunk(pieces, dim)[layout.shard_index(rank, dim)]
    return x


def slice_batch(
    batch: Batch,
    strategies: DatasetStrategy,
    mesh: MeshSpec,
    rank: int,
    dp_axis: str = "dp",
) -> Batch:
    """Rank ``rank``'s piece of every input of a global ``batch``.

    ``batch`` is a tensor or a tuple/list of tensors; the result has the same kind. See
    :func:`input_layouts` for ``strategies``. On ``{"dp": 2, "tp": 2}``, strategy ``(2, 2)``
    on a ``[4, 6]`` input gives:

        rank  (dp, tp)  rows  cols
        0     (0, 0)    0:2   0:3
        1     (0, 1)    0:2   3:6
        2     (1, 0)    2:4   0:3
        3     (1, 1)    2:4   3:6
    """
    inputs, rebuild = _as_inputs(batch)
    if isinstance(batch, torch.Tensor) and _is_single_strategy(strategies):
        strategies = (strategies,)  # type: ignore[assignment]
    _check_int("rank", rank, 0)
    if rank >= mesh.size:
        raise LayoutError(f"rank={rank} is not in mesh {mesh.as_dict()!r} of {mesh.size} ranks")
    layouts = input_layouts(strategies, [x.shape for x in inputs], mesh, dp_axis=dp_axis)
    return rebuild([_cut(x, lay, rank, 0) for x, lay in zip(inputs, layouts, strict=True)])


def _is_single_strategy(strategies: object) -> bool:
    return isinstance(strategies, TensorLayout) or (
        isinstance(strategies, Sequence)
        and not isinstance(strategies, str)
        and all(isinstance(n, int) for n in strategies)
    )


@dataclass(frozen=True, slots=True)
class InputSlicer:
    """Cuts the inputs of loaded batches to one rank's pieces, given their layouts.

    A rank loads the samples of its dim-0 piece (:meth:`load_shard`) when every input splits
    dim 0 the same way, and the whole global batch otherwise; :meth:`slice_loaded` then cuts
    what is left. Build it with :meth:`build`.
    """

    layouts: tuple[TensorLayout, ...]
    rank: int

    @classmethod
    def build(
        cls,
        strategies: DatasetStrategy,
        shapes: Sequence[Sequence[int]],
        mesh: MeshSpec,
        rank: int,
        *,
        dp_axis: str = "dp",
    ) -> InputSlicer:
        """Resolve ``strategies`` for inputs of global ``shapes`` (see :func:`input_layouts`)."""
        _check_int("rank", rank, 0)
        if rank >= mesh.size:
            raise LayoutError(f"rank={rank} is not in mesh {mesh.as_dict()!r}")
        return cls(input_layouts(strategies, shapes, mesh, dp_axis=dp_axis), rank)

    def load_shard(self) -> tuple[int, int]:
        """``(num_shards, shard_id)`` of the samples this rank loads (MindSpore's pair)."""
        firsts = {layout.dims[0] if layout.ndim else () for layout in self.layouts}
        if len(firsts) != 1 or not self.layouts[0].ndim:
            return 1, 0
        first = self.layouts[0]
        return first.splits()[0], first.shard_index(self.rank, 0)

    def slice_loaded(self, batch: Batch) -> Batch:
        """Cut a batch holding this rank's loaded samples to its pieces of every input."""
        inputs, rebuild = _as_inputs(batch)
        if len(inputs) != len(self.layouts):
            raise LayoutError(
                f"the loader yields {len(inputs)} inputs but {len(self.layouts)} strategies "
                "were given; give one strategy per input"
            )
        shards, _ = self.load_shard()
        first = 1 if shards > 1 else 0
        out = []
        for i, (x, layout) in enumerate(zip(inputs, self.layouts, strict=True)):
            layout.check_shape((x.shape[0] * shards, *x.shape[1:]), f"input {i}")
            out.append(_cut(x, layout, self.rank, first))
        return rebuild(out)


# Loader ---------------------------------------------------------------------------------------


class _JobLike(Protocol):
    mesh: MeshSpec | None
    config: Any
    device_mesh: DeviceMesh | None


class ShardedLoader:
    """Batches of this rank's slice of every global batch, collated, with a resumable position.

    Each iteration runs from the current ``(epoch, step)`` to the end of the epoch, then moves
    to the next epoch. ``step`` counts batches handed to the caller, so a ``state_dict()``
    taken between two ``job.step`` calls resumes at the next unseen batch, whatever the
    worker processes had prefetched.

    Args:
        dataset: a map-style dataset (``__len__`` and ``__getitem__``).
        global_batch_size, dp_size, dp_rank, shuffle, seed, drop_last: as in
            :class:`ShardedSampler`.
        collate_fn: turns a list of samples into a batch; ``default_collate`` if None.
        num_workers: worker processes of the underlying ``torch.utils.data.DataLoader``.
        slicer: per-input strategies (:class:`InputSlicer`); it decides which samples this
            rank loads, so leave ``dp_size`` and ``dp_rank`` at their defaults with it.

    Example:
        >>> data = torch.arange(8.0).unsqueeze(1)
        >>> loader = ShardedLoader(data, global_batch_size=4, dp_size=2, dp_rank=0, shuffle=False)
        >>> [b.flatten().tolist() for b in loader]
        [[0.0, 1.0], [4.0, 5.0]]
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        *,
        global_batch_size: int,
        dp_size: int = 1,
        dp_rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        num_workers: int = 0,
        slicer: InputSlicer | None = None,
    ) -> None:
        if slicer is not None:
            if (dp_size, dp_rank) != (1, 0):
                raise ConfigError(
                    f"ShardedLoader got dp_size={dp_size}, dp_rank={dp_rank} and a slicer; the "
                    "slicer decides which samples this rank loads: leave dp_size and dp_rank out"
                )
            dp_size, dp_rank = slicer.load_shard()
        _check_int("num_workers", num_workers, 0)
        self.dataset = dataset
        self.sampler = ShardedSampler(
            len(dataset),  # type: ignore[arg-type]
            global_batch_size=global_batch_size,
            dp_size=dp_size,
            dp_rank=dp_rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        self.collate_fn = collate_fn or default_collate
        self.num_workers = num_workers
        self.slicer = slicer

    @classmethod
    def for_job(
        cls, dataset: Dataset[Any], job: _JobLike, *, global_batch_size: int, **kwargs: Any
    ) -> ShardedLoader:
        """The loader for this process of ``job``, as its ``dataset_strategy`` says.

        * ``stand_alone`` (no device mesh), ``dataset_strategy="full_batch"``, and simulated
          ranks (:func:`plait.testing.simulate`, where one process plays every rank and
          ``job.step`` takes global batches): whole global batches.
        * ``"data_parallel"``: this rank's slice, by its coordinate on ``config.dp_axis``;
          ranks of one model-parallel group get the same data.
        * per-input strategies: this rank's piece of every input (:class:`InputSlicer`,
          shapes taken from ``dataset[0]``).

        Other keyword arguments go to the constructor.
        """
        mesh, cfg = job.mesh, job.config
        strategy = cfg.dataset_strategy
        if (
            job.device_mesh is None
            or mesh is None
            or simulated_ranks() is not None
            or strategy == "full_batch"
        ):
            return cls(dataset, global_batch_size=global_batch_size, **kwargs)
        found = job.device_mesh.get_coordinate()
        if found is None:  # a rank outside its own job's mesh: parallelize makes none
            raise ConfigError(f"ShardedLoader: this rank is not on the job's mesh {mesh}")
        coord = tuple(found)
        if strategy == "data_parallel":
            dp = cfg.dp_axis
            if dp not in mesh.axis_names:
                return cls(dataset, global_batch_size=global_batch_size, **kwargs)
            dp_rank = coord[mesh.axis_index(dp)]
            return cls(
                dataset,
                global_batch_size=global_batch_size,
                dp_size=mesh.axis_size(dp),
                dp_rank=dp_rank,
                **kwargs,
            )
        collate = kwargs.get("collate_fn") or default_collate
        shapes = _global_shapes(collate([dataset[0]]), global_batch_size)
        slicer = InputSlicer.build(
            strategy, shapes, mesh, _linear_rank(mesh, coord), dp_axis=cfg.dp_axis
        )
        return cls(dataset, global_batch_size=global_batch_size, slicer=slicer, **kwargs)

    def __len__(self) -> int:
        """Batches per epoch."""
        return self.sampler.num_batches

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    @property
    def step(self) -> int:
        """Batches of the current epoch already handed out."""
        return self.sampler.step

    def set_epoch(self, epoch: int) -> None:
        """As :meth:`ShardedSampler.set_epoch`."""
        self.sampler.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """The position ``{"epoch", "step", ...}``; see :meth:`ShardedSampler.state_dict`."""
        return self.sampler.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.sampler.load_state_dict(state)

    def __iter__(self) -> Iterator[Any]:
        sampler = self.sampler
        epoch, start = sampler.epoch, sampler.step
        loader = DataLoader(
            self.dataset,
            batch_sampler=list(sampler.local_batches(epoch, start)),
            collate_fn=self.collate_fn,
            num_workers=self.num_workers,
        )
        logger.debug("epoch %d: batches %d..%d", epoch, start, sampler.num_batches - 1)
        for batch in loader:
            sampler.step += 1
            yield batch if self.slicer is None else self.slicer.slice_loaded(batch)
        sampler.epoch, sampler.step = epoch + 1, 0


def _global_shapes(sample_batch: Any, global_batch_size: int) -> list[tuple[int, ...]]:
    inputs, _ = _as_inputs(sample_batch)
    return [(global_batch_size, *x.shape[1:]) for x in inputs]


def _linear_rank(mesh: MeshSpec, coord: Sequence[int]) -> int:
    """The rank of a mesh coordinate (row-major, the inverse of ``MeshSpec.coordinate``)."""
    rank = 0
    for size, c in zip(mesh.shape, coord, strict=True):
        rank = rank * size + c
    return rank


def planned_piece(batch: Any, config: ParallelConfig) -> Any:
    """The piece of a step's ``batch`` a plan is made for (and a job's program traced on):
    1/``grad_accumulation`` of it, and of that one of ``interleave_num`` copies."""
    k, copies = config.grad_accumulation, config.copies
    named = f"grad_accumulation={k} micro-batches"
    if copies > 1:
        named = f"grad_accumulation={k} micro-batches of interleave_num={copies} copies"
    return split_micro_batches(batch, config.planned_pieces, pieces=named)[0]


def split_micro_batches(batch: Any, k: int, *, pieces: str = "") -> list[Any]:
    """Cut every tensor of ``batch`` into ``k`` equal pieces along dim 0 (``[batch]`` if k == 1).
    ``pieces`` names them in the error (default: ``grad_accumulation=k micro-batches``)."""
    if k == 1:
        return [batch]
    leaves = [x for x in tree_leaves(batch) if isinstance(x, torch.Tensor)]
    for x in leaves:
        if x.ndim == 0 or x.shape[0] % k:
            raise ShardingError(
                f"batch tensor of shape {tuple(x.shape)}: dim 0 does not divide into "
                f"{pieces or f'grad_accumulation={k} micro-batches'}; use a batch size "
                f"divisible by {k}"
            )
    return [
        tree_map(lambda x, i=i: x.chunk(k)[i] if isinstance(x, torch.Tensor) else x, batch)
        for i in range(k)
    ]
