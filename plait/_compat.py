"""Every private torch import plait makes, behind one door.

torch 2.13 and 2.14 are supported. The names below live in underscore modules or in
``torch.testing._internal`` and may move between releases; when one does, this file is the only
one to change. Each import is probed once at import time and failures are re-raised with the
torch version and what plait needed it for.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed._local_tensor

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName
    from torch.distributed.tensor import DTensor, Placement

__all__ = [
    "TORCH_VERSION",
    "FakeStore",
    "HigherOrderOperator",
    "LocalTensor",
    "LocalTensorMode",
    "StridedShard",
    "TorchDispatchMode",
    "aot_joint_graph",
    "custom_reducer",
    "dispatch_modes_suspended",
    "funcol",
    "functorch_levels_restored",
    "implicit_replication_active",
    "load_dcp_keys",
    "local_tensor_mode_active",
    "output_structure",
    "own_per_rank",
    "partition_joint_graph",
    "same_on_every_rank",
    "simulated_ranks",
    "simulation_suspended",
    "tree_flatten",
    "tree_leaves",
    "tree_map",
    "tree_unflatten",
    "unflatten_mesh_dim",
]

TORCH_VERSION = torch.__version__


def _fail(what: str, purpose: str, err: Exception) -> ImportError:
    return ImportError(
        f"plait needs {what} from torch for {purpose}, but torch {TORCH_VERSION} does not provide "
        f"it ({err}); plait supports torch>=2.13,<2.15"
    )


try:  # simulated ranks: one real tensor per rank inside one process
    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
except ImportError as e:  # pragma: no cover - depends on the torch build
    raise _fail("torch.distributed._local_tensor", "plait.testing.simulate", e) from e

try:  # the fake process group's store, for simulated worlds
    from torch.testing._internal.distributed.fake_pg import FakeStore
except ImportError as e:  # pragma: no cover
    raise _fail("FakeStore", "plait.testing.simulate", e) from e

try:  # layouts that split one dim over several mesh axes against mesh order
    from torch.distributed.tensor.placement_types import _StridedShard as StridedShard
except ImportError as e:  # pragma: no cover
    raise _fail("_StridedShard", "multi-axis layouts", e) from e

try:  # walking nested batches and step results (tuples, lists, dicts of tensors)
    from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten
except ImportError as e:  # pragma: no cover
    raise _fail("torch.utils._pytree", "nested batches", e) from e

try:  # collectives on plain tensors that autograd and tracing see through
    import torch.distributed._functional_collectives as funcol
except ImportError as e:  # pragma: no cover
    raise _fail("torch.distributed._functional_collectives", "redistribution", e) from e

try:  # watching every op a step dispatches (plait.testing.comm.CollectiveLog)
    from torch._ops import HigherOrderOperator
    from torch.utils._python_dispatch import TorchDispatchMode
except ImportError as e:  # pragma: no cover
    raise _fail("TorchDispatchMode, HigherOrderOperator", "collective logs", e) from e


def custom_reducer(init: Any, reduce: Callable[[Any, Any], Any]) -> Any:
    """torch's private reducer of a pipeline's per-micro-batch outputs (``merge_chunks``), for
    a scalar output (a loss computed inside the model); imported here, when a pipeline is
    built, since torch's pipelining pulls in dynamo (seconds of ``import plait``)."""
    try:
        from torch.distributed.pipelining.microbatch import _CustomReducer
    except ImportError as e:  # pragma: no cover
        raise _fail("pipelining.microbatch._CustomReducer", "pipeline outputs", e) from e
    return _CustomReducer(init, reduce)


def local_tensor_mode_active() -> bool:
    """True inside a ``LocalTensorMode`` (a simulated world)."""
    from torch.distributed._local_tensor import local_tensor_mode

    return local_tensor_mode() is not None


def simulated_ranks() -> tuple[int, ...] | None:
    """The simulated ranks of the active ``LocalTensorMode``, or None outside one."""
    from torch.distributed._local_tensor import local_tensor_mode

    mode = local_tensor_mode()
    if mode is None or getattr(mode, "_disable", False):  # suspended: one plain process
        return None
    return tuple(sorted(mode.ranks))


def own_per_rank(tensor: torch.Tensor, ranks: tuple[int, ...]) -> torch.Tensor:
    """A LocalTensor whose every rank owns a private copy of its local piece.

    Under ``LocalTensorMode`` a replicated DTensor made from a plain tensor keeps that one
    tensor for every simulated rank, and sharded ones keep views of the same storage; an
    in-place optimizer update then lands once per rank on shared memory. Real processes never
    share, so simulation must not either.
    """
    pieces = (
        tensor._local_tensors if isinstance(tensor, LocalTensor) else dict.fromkeys(ranks, tensor)
    )
    with torch.distributed._local_tensor.maybe_disable_local_tensor_mode():
        return LocalTensor({r: pieces[r].detach().clone() for r in ranks})


def same_on_every_rank(tensor: torch.Tensor, what: str) -> torch.Tensor:
    """The plain tensor a LocalTensor holds on every rank; an error if ranks disagree."""
    if not isinstance(tensor, LocalTensor):
        return tensor
    pieces = list(tensor._local_tensors.values())
    with torch.distributed._local_tensor.maybe_disable_local_tensor_mode():
        first = pieces[0]
        for other in pieces[1:]:
            if not torch.equal(first, other):
                raise RuntimeError(f"{what}: simulated ranks hold different values")
        return first.clone()


@contextlib.contextmanager
def simulation_suspended() -> Iterator[None]:
    """The block runs as one plain process, outside the active simulated world (if any).

    torch.export of some models (Hugging Face's: constant lifting) fails while a
    ``LocalTensorMode`` is active; capture runs on fake tensors and needs no simulated rank.
    """
    from torch.distributed._local_tensor import local_tensor_mode

    mode = local_tensor_mode()
    if mode is None:
        yield
        return
    with mode.disable():
        yield


def greedy_redistribution_planning():  # type: ignore[no-untyped-def]
    """Make DTensor price candidate strategies with its greedy redistribution planner.

    DTensor's sharding propagation prices every candidate strategy of an op with a
    Dijkstra search over placements; on 3-D meshes with 4-D activations (batched attention)
    that search takes minutes per op. The greedy planner gives the same plans for the moves
    plait makes and costs microseconds. Layouts with strided shards still use the exact search.
    """
    from torch.distributed.tensor._redistribute import use_min_cost_redistribution_plan

    return use_min_cost_redistribution_plan(False)


@contextlib.contextmanager
def traced_as_rank(device_mesh, rank: int) -> Iterator[None]:  # type: ignore[no-untyped-def]
    """DTensor code in the block sees ``rank``'s coordinate on every DeviceMesh.

    Used to trace the per-rank programs of a simulated world one rank at a time, in this one
    process (a real process traces its own rank and needs nothing of this). A DeviceMesh keeps
    the coordinate of the process that built it; DTensor reads it through ``get_coordinate``
    and ``_sym_get_coordinate``, which are patched on the class for the block (submeshes and
    meshes cached by DTensor included), each answering for ``rank``.
    """
    from torch.distributed.device_mesh import DeviceMesh

    root = device_mesh.mesh
    where = (root == rank).nonzero().tolist()
    if len(where) != 1:
        raise ValueError(f"rank {rank} is not on the device mesh {root.tolist()}")
    by_name = dict(zip(device_mesh.mesh_dim_names or (), where[0], strict=True))
    sizes = dict(zip(device_mesh.mesh_dim_names or (), root.shape, strict=True))

    def coordinate(mesh) -> list[int]:  # type: ignore[no-untyped-def]
        names = mesh.mesh_dim_names
        if names is None:
            return list(where[0])
        out = []
        for name in names:
            if name in by_name:
                out.append(by_name[name])
                continue
            parts = name.split("_")  # a flattened mesh dim, e.g. "dp_tp"
            if not all(p in by_name for p in parts):
                raise ValueError(f"mesh dim {name!r} is not a dim of {list(by_name)}")
            index = 0
            for part in parts:
                index = index * sizes[part] + by_name[part]
            out.append(index)
        return out

    saved = (DeviceMesh.get_coordinate, DeviceMesh._sym_get_coordinate)
    # torch annotates get_coordinate's answer as a tuple; DTensor only indexes it (a list serves)
    DeviceMesh.get_coordinate = lambda self: coordinate(self)  # type: ignore[method-assign, assignment, return-value]
    DeviceMesh._sym_get_coordinate = lambda self, index: coordinate(self)[index]  # type: ignore[method-assign]
    try:
        yield
    finally:
        DeviceMesh.get_coordinate, DeviceMesh._sym_get_coordinate = saved  # type: ignore[method-assign]


def rank_pieces(value: torch.Tensor, ranks: tuple[int, ...]) -> dict[int, torch.Tensor]:
    """Each simulated rank's plain tensor of ``value`` (the same tensor for a plain one)."""
    if isinstance(value, LocalTensor):
        return dict(value._local_tensors)
    return dict.fromkeys(ranks, value)


def join_rank_pieces(pieces: dict[int, torch.Tensor]) -> torch.Tensor:
    """One LocalTensor holding ``pieces`` (rank -> plain tensor)."""
    with torch.distributed._local_tensor.maybe_disable_local_tensor_mode():
        return LocalTensor(dict(pieces))


def dtensor_like(template: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """A DTensor laid out exactly as the DTensor ``template`` (same mesh, placements, global
    shape and strides) whose local piece is ``local``: no autograd node, no spec rebuilt.

    A training step hands every parameter its gradient this way; ``DTensor.from_local`` costs
    an autograd function and a new spec per call, tens of microseconds each.
    """
    dtensor = cast("DTensor", template)
    return type(dtensor)(local, dtensor._spec, requires_grad=False)


def group_ranks(group_name: str) -> list[int]:
    """The global ranks of the process group registered as ``group_name`` (a functional
    collective's group argument), in group order."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    return list(dist.get_process_group_ranks(_resolve_process_group(cast("GroupName", group_name))))


@contextlib.contextmanager
def dispatch_modes_suspended() -> Iterator[None]:
    """No torch dispatch mode is active inside the block (a simulated world's suspended
    ``LocalTensorMode`` included): torch's functionalization of an exported program refuses
    to run under one."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        yield


@contextlib.contextmanager
def functorch_levels_restored() -> Iterator[None]:
    """After the block, functorch's transform levels (vmap, grad) are what they were before:
    code that fails inside a vmap (capture retracing one) leaves no level open behind it."""
    from torch._C import _functorch

    before = _functorch.maybe_current_level() or 0
    try:
        yield
    finally:
        while (_functorch.maybe_current_level() or 0) > before:
            _functorch._vmap_decrement_nesting()


def node_meta_preserved():  # type: ignore[no-untyped-def]
    """Inside it, FX tracing copies the current node meta (``annotated``) onto new nodes."""
    import torch.fx.traceback as fx_traceback

    return fx_traceback.preserve_node_meta()


def annotated(tags: dict[str, object]):  # type: ignore[no-untyped-def]
    """Nodes traced inside it carry ``tags`` in ``node.meta["custom"]`` (see node_meta_preserved)."""
    import torch.fx.traceback as fx_traceback

    return fx_traceback.annotate(tags)


def node_tags(node: torch.fx.Node) -> dict[str, object]:
    """The ``annotated`` tags of a traced node ({} when it has none)."""
    return node.meta.get("custom") or {}


def load_dcp_keys(path: str, keys: set[str] | None) -> dict[str, torch.Tensor]:
    """Whole tensors (``keys``, or all) from a DCP checkpoint, on one process, no process group.

    DCP's own reader for this is private (``_load_state_dict_from_keys``).
    """
    try:
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
    except ImportError as e:  # pragma: no cover
        raise _fail("_load_state_dict_from_keys", "plait checkpoint merge", e) from e
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": yes
        warnings.filterwarnings("ignore", message=".*in a single process")
        return _load_state_dict_from_keys(keys, storage_reader=dcp.FileSystemReader(path))


def local_shape_and_offset(
    global_shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    coordinate: Sequence[int],
    placements: tuple[Placement, ...],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offset of its first element) of the piece that the rank at
    ``coordinate`` of a mesh of ``mesh_shape`` holds of a DTensor with ``placements``.

    DTensor's own computation (``_compute_local_shape_and_global_offset``, private), given an
    explicit coordinate so that a simulated world can ask for every rank from one process. It
    follows strided shards: for plait's layouts (strided shards only on mesh axes before the
    plain shard of the same dim) each piece is one block, starting at the offset returned.
    """
    try:
        from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    except ImportError as e:  # pragma: no cover
        raise _fail("_compute_local_shape_and_global_offset", "loading pretrained slices", e) from e
    # Plain ints in, plain ints out: outside a simulated world's mode, whose LocalTensors
    # would otherwise stand in for the index tensors DTensor builds on the way.
    with torch.distributed._local_tensor.maybe_disable_local_tensor_mode():
        shape, offset = _compute_local_shape_and_global_offset(
            tuple(global_shape), tuple(mesh_shape), list(coordinate), list(placements)
        )
    return tuple(int(s) for s in shape), tuple(int(o) for o in offset)


def implicit_replication_active() -> bool:
    """Whether DTensor treats plain tensors as replicated now (inside ``implicit_replication``).

    torch's context manager sets the flag on entry and clears it on exit, so a nested use would
    switch it off for the rest of the outer block: plait enters it only when it is off.
    """
    return bool(torch._C._get_dtensor_allow_implicit_replication())


def unflatten_mesh_dim(device_mesh, dim: str, sizes: tuple[int, ...], names: tuple[str, ...]):  # type: ignore[no-untyped-def]
    """``device_mesh`` with mesh dim ``dim`` cut into ``names`` of ``sizes`` (row-major: the
    last name's ranks are consecutive coordinates of ``dim``), sharing the root mesh.

    Optimizer parallel's shard groups (HSDP) are the last of two such dims and the groups
    across them the first; ``DeviceMesh._unflatten`` (private) builds both, with a process
    group each, on every rank (real or simulated).
    """
    index = list(device_mesh.mesh_dim_names or ()).index(dim)
    try:
        unflatten = device_mesh._unflatten
    except AttributeError as e:  # pragma: no cover
        raise _fail("DeviceMesh._unflatten", "optimizer_weight_shard_size (HSDP)", e) from e
    return unflatten(index, sizes, names)


def output_structure(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The pytree spec of ``model(*args, **kwargs)``'s output (a Hugging Face ``ModelOutput``
    with its fields, a tuple...), from one forward on fake tensors (nothing computed)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._pytree import tree_flatten

    with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
        out = model(*args, **kwargs)
    return tree_flatten(out)[1]


def aot_joint_graph(fn: Any, example: tuple[Any, ...]) -> torch.fx.GraphModule:
    """AOTAutograd's joint forward-and-backward graph of ``fn`` on ``example`` (fake
    tensors; tensor subclasses such as DTensor desugared into their local ops): a pipeline
    stage's per-rank program (:mod:`plait.runtime.pipeline.stage_program`)."""
    from torch._functorch.aot_autograd import aot_export_joint_simple

    return cast("torch.fx.GraphModule", aot_export_joint_simple(fn, example, trace_joint=True))


def aot_forward_graph(fn: Any, example: tuple[Any, ...]) -> torch.fx.GraphModule:
    """AOTAutograd's forward graph of ``fn`` on ``example``, no backward (fake tensors; tensor
    subclasses such as DTensor desugared into their local ops): a pipeline stage's evaluation
    program (:mod:`plait.runtime.pipeline.stage_program`)."""
    from torch._functorch.aot_autograd import aot_export_joint_simple

    return cast("torch.fx.GraphModule", aot_export_joint_simple(fn, example, trace_joint=False))


def reparametrized(module: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> Any:
    """Inside it, ``module``'s parameters and buffers named in ``tensors`` are those tensors
    (what ``torch.func.functional_call`` does around a call, without calling the module)."""
    from torch.nn.utils.stateless import _reparametrize_module

    return _reparametrize_module(module, tensors)


def partition_joint_graph(
    graph: torch.fx.GraphModule, example: tuple[Any, ...], forward_outputs: int
) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """The forward and backward graphs of a joint graph (torch's default partitioner: the
    backward keeps what the forward saved, nothing recomputed)."""
    from torch._functorch.partitioners import default_partition

    return default_partition(graph, example, num_fwd_outputs=forward_outputs)
