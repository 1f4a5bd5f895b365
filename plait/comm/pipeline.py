"""The door to ``torch.distributed.pipelining``: splitting a model into stages, building this
rank's stages and running a schedule, and the data-parallel gradient mean of a stage.

A model is split by tracing its forward once on one micro-batch (``pipeline``, torch.export
underneath) and cutting the graph at the first module of every stage after the first
(``SplitPoint.BEGINNING``); each stage keeps the original parameter names. Stage ``s`` runs on
the pipeline group's rank ``s % pp`` (looped: ``gpipe``, ``1f1b``, ``interleaved_1f1b`` with
several stages a rank) or, for the V-shaped zero-bubble schedule, ranks ``s`` and
``2 pp - 1 - s``. ``plait/runtime/pipeline/job.py`` holds the job that uses them. The DTensor
side of a stage compiled into a per-rank program (a parameter made from its local piece
inside the trace, its gradient added to ``.grad`` after) is here too, for
``plait/runtime/pipeline/stage_program.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import operator
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
    SplitPoint,
    pipeline,
)
from torch.distributed.pipelining.microbatch import TensorChunkSpec
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.overrides import TorchFunctionMode

from plait._compat import (
    custom_reducer,
    greedy_redistribution_planning,
    tree_map,
    unflatten_mesh_dim,
)

__all__ = [
    "SCHEDULES",
    "CarriedInputs",
    "Handovers",
    "PieceLayout",
    "add_piece_to_grad",
    "build_stages",
    "carry_late_inputs",
    "constant_handovers",
    "defer_weight_pass",
    "keep_constants_without_gradient",
    "layout_of",
    "make_schedule",
    "mean_over_group",
    "output_merge",
    "parameter_from_piece",
    "run_schedule",
    "shard_stage",
    "split_model",
    "stage_indices",
    "stage_on_submesh",
    "start_sum_over_world",
    "sum_over_group",
]

logger = logging.getLogger(__name__)

SCHEDULES: dict[str, Any] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zero_bubble": ScheduleInterleavedZeroBubble,
    "zero_bubble_v": ScheduleZBVZeroBubble,
}
"""plait's schedule names -> torch's schedule classes."""


def split_model(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    starts: Sequence[str],
) -> Any:
    """The model split before each module of ``starts`` (one micro-batch's inputs traced).

    A Hugging Face model returns its key/value cache (a ``DynamicCache``, which torch's
    export cannot carry out of a graph) unless its config says ``use_cache=False``; training
    never reads it, so the split is traced without it."""
    with without_cache(model):
        pipe = pipeline(
            model,
            mb_args=args,
            mb_kwargs=kwargs or None,
            split_spec={name: SplitPoint.BEGINNING for name in starts},
        )
    drop_export_checks(pipe.split_gm)
    return pipe


_EXPORT_CHECKS = ("aten._assert_tensor_metadata.default",)
"""The op torch's export leaves in a graph to check a value's dtype, device and layout as
traced (``x.to(dtype)`` leaves one): nothing to compute, and wrong under a stage's autocast,
where a product traced in fp32 runs in bf16 (a Hugging Face Llama's ``lm_head`` output
asserted fp32 failed its stage). The capture drops it with the export's other checks
(:data:`plait.graph.convert.EXPORT_ASSERTIONS`); those check shapes and values, which a
stage's autocast does not change, so the stages keep them."""


def drop_export_checks(root: torch.fx.GraphModule) -> int:
    """Remove the export's trace checks (:data:`_EXPORT_CHECKS`) from every stage graph of a
    split, in place; returns how many went."""
    dropped = 0
    for module in (root, *root.modules()):
        if not isinstance(module, torch.fx.GraphModule):
            continue
        checks = [
            n
            for n in module.graph.nodes
            if n.op == "call_function" and str(n.target) in _EXPORT_CHECKS and not n.users
        ]
        for node in checks:
            module.graph.erase_node(node)
        if checks:
            module.recompile()
            dropped += len(checks)
    return dropped


@dataclass(frozen=True)
class CarriedInputs:
    """What :func:`carry_late_inputs` did to a split: ``carried`` model inputs the first stage
    now takes and hands on, stage to stage, to the later stages that read them; ``unread``
    model inputs no stage reads (the trace found them to be another input's tensor), which
    the first stage is not given."""

    carried: tuple[str, ...] = ()
    unread: tuple[str, ...] = ()


def carry_late_inputs(pipe: Any) -> CarriedInputs:
    """Rewrite ``pipe``'s split so that every model input read by a later stage (Hugging
    Face's ``labels=``, read by the loss inside the model, in the last stage) enters at the
    first stage and travels with the activations: each stage from the first to the last
    reader takes it as one more input and returns it as one more output, and the readers
    read that. torch's schedules hand a micro-batch's inputs to the first stage alone, so
    this is what lets ``model(**batch).loss`` run in stages as written. Carried tensors
    need no gradient (token ids); they cost one more send per stage boundary."""
    graph = pipe.split_gm.graph
    calls = [n for n in graph.nodes if n.op == "call_module"]
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    carried: list[str] = []
    for root in inputs:
        readers = [i for i, call in enumerate(calls) if root in call.args]
        if any(i > 0 for i in readers):
            _carry(pipe.split_gm, calls, root, last=max(readers), first_reads=0 in readers)
            carried.append(root.name)
    unread = tuple(n.name for n in inputs if not n.users)
    if not carried:
        return CarriedInputs((), unread)
    for name, sub in pipe.split_gm.named_children():
        if isinstance(sub, torch.fx.GraphModule) and name in {c.target for c in calls}:
            sub.recompile()
    pipe.split_gm.recompile()
    return CarriedInputs(tuple(carried), unread)


def _carry(
    root_gm: torch.fx.GraphModule, calls: list[Any], root: Any, *, last: int, first_reads: bool
) -> None:
    """Thread the model input ``root`` from the first stage to stage ``last`` (see
    :func:`carry_late_inputs`): stage ``s`` returns it, stage ``s + 1`` takes it."""
    graph = root_gm.graph
    value = root  # what the current stage's call takes it as, in the split graph
    for s in range(last):
        sub = root_gm.get_submodule(calls[s].target)
        inner = _inner_input(sub, calls[s], value, name=root.target if s == 0 else None)
        if s == 0 and not first_reads:
            calls[0].args = (*calls[0].args, root)
        index = _append_output(root_gm, calls[s], sub, inner)
        with graph.inserting_after(_last_user(calls[s])):
            handed = graph.call_function(operator.getitem, (calls[s], index))
        nxt = calls[s + 1]
        if root in nxt.args:  # a reader: it reads the carried value where it read the input
            nxt.args = tuple(handed if a is root else a for a in nxt.args)
        else:
            nxt_sub = root_gm.get_submodule(nxt.target)
            _new_placeholder(nxt_sub, f"carried_{root.name}", inner.meta.get("val"))
            nxt.args = (*nxt.args, handed)
        value = handed


def _inner_input(sub: Any, call: Any, value: Any, *, name: str | None) -> Any:
    """The placeholder of stage module ``sub`` that the split graph's ``value`` feeds (one is
    added, named ``name``, where the stage does not take it: the first stage, for an input it
    does not read itself)."""
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    for placeholder, arg in zip(placeholders, call.args, strict=False):
        if arg is value:
            return placeholder
    example = value.meta.get("val") if hasattr(value, "meta") else None
    return _new_placeholder(sub, name or value.name, example)


def _new_placeholder(sub: Any, name: str, example: Any) -> Any:
    """A placeholder appended after ``sub``'s others (torch's stage pairs a stage's
    placeholders with its call's arguments in order), its example value kept for the
    stage's receive buffers."""
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    anchor = placeholders[-1] if placeholders else next(iter(sub.graph.nodes))
    insert = sub.graph.inserting_after if placeholders else sub.graph.inserting_before
    with insert(anchor):
        node = sub.graph.placeholder(name)
    node.meta["val"] = example
    return node


def _append_output(root_gm: Any, call: Any, sub: Any, value: Any) -> int:
    """``value`` returned by stage module ``sub`` as its last output (a copy: torch's stage
    hands outputs on as they are, and an output that is an input of the same stage would
    alias it); its index. A stage returning one value is made to return a tuple, its one
    reader in the split graph reading the tuple's first item."""
    out = next(n for n in sub.graph.nodes if n.op == "output")
    returned = out.args[0]
    if not isinstance(returned, tuple | list):
        graph = root_gm.graph
        with graph.inserting_after(call):
            first = graph.call_function(operator.getitem, (call, 0))
        call.replace_all_uses_with(first, delete_user_cb=lambda user: user is not first)
        returned = (returned,)
    with sub.graph.inserting_before(out):
        copied = sub.graph.call_function(torch.ops.aten.clone.default, (value,))
    copied.meta["val"] = value.meta.get("val")
    out.args = ((*returned, copied),)
    return len(returned)


def _last_user(call: Any) -> Any:
    """The split graph node after which a new reader of ``call``'s outputs goes: its last
    ``getitem`` (torch's stage numbers a stage's outputs by the order of their readers)."""
    items = [u for u in call.users if u.target is operator.getitem]
    return max(items, key=lambda u: u.args[1]) if items else call


@contextlib.contextmanager
def without_cache(model: nn.Module) -> Iterator[None]:
    """``model.config.use_cache`` off inside (Hugging Face models), as it was after."""
    config = getattr(model, "config", None)
    cached = getattr(config, "use_cache", None)
    if not isinstance(cached, bool) or not cached:
        yield
        return
    config.use_cache = False  # type: ignore[union-attr]
    try:
        yield
    finally:
        config.use_cache = cached  # type: ignore[union-attr]


def stage_indices(schedule: str, rank: int, pp: int, virtual: int) -> list[int]:
    """The stages the pipeline group's ``rank`` runs (V-shaped for ``zero_bubble_v``)."""
    if schedule == "zero_bubble_v":
        return [rank, 2 * pp - 1 - rank]
    return [rank + k * pp for k in range(virtual)]


def build_stages(
    pipe: Any,
    indices: Sequence[int],
    device: torch.device,
    group: Any,
    example: tuple[tuple[Any, ...], dict[str, Any]] = ((), {}),
) -> list:
    """This rank's stages of ``pipe``, each warming up its links to other ranks only, and
    none computing or waiting for the gradient of a value that carries none
    (:func:`keep_constants_without_gradient`; ``example``: one micro-batch's model inputs,
    as traced)."""
    stages = [pipe.build_stage(i, device, group) for i in indices]
    try:
        handovers = constant_handovers(pipe, *example)
    except Exception as e:  # an analysis for speed: the stages run without it, as torch builds them
        logger.info("pipeline: every value between stages takes a gradient (%s)", e)
        handovers = Handovers({}, {})
    for stage in stages:
        _warm_up_remote_peers_only(stage)
        keep_constants_without_gradient(stage, handovers)
    return stages


def _warm_up_remote_peers_only(stage: Any) -> None:
    """Drop, from the stage's first-step handshake with its neighbour stages, the messages
    addressed to its own rank. The V schedule puts stages ``pp - 1`` and ``pp`` on one rank:
    torch's runtime hands their activations and gradients over in memory
    (``set_local_fwd_input``), but the handshake still posts a send and a receive to the
    rank itself, which gloo cannot carry (the pair's socket resets). NCCL would accept them;
    skipping them loses nothing, the in-memory hand-over needs no link."""
    all_ops = stage._get_init_p2p_neighbors_ops
    me = dist.get_rank(stage.group)

    def remote_ops() -> list[dist.P2POp]:
        return [op for op in all_ops() if op.group_peer != me]  # a group rank, always set

    stage._get_init_p2p_neighbors_ops = remote_ops


@dataclass(frozen=True)
class Handovers:
    """Which values between stages carry no gradient (:func:`constant_handovers`): by stage
    index, the positions of the outputs it hands on and of the inputs it receives."""

    outputs: dict[int, frozenset[int]]
    inputs: dict[int, frozenset[int]]


def constant_handovers(pipe: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Handovers:
    """The values stages hand each other that carry no gradient (rotary tables, masks,
    positions made in the first stage and read by later ones). torch's stages mark every
    floating value they receive as needing a gradient, so a receiving stage would compute
    one, sum it over tensor parallel (collectives for nothing) and send it back to be
    dropped. Found by running the split once on fake tensors (no memory, no compute) with
    the model's inputs (``args``, ``kwargs``: one micro-batch), as autograd sees it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    graph = pipe.split_gm.graph
    calls = [n for n in graph.nodes if n.op == "call_module"]
    names = [n.target for n in graph.nodes if n.op == "placeholder"]
    given = dict(zip(names, args, strict=False)) | kwargs
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, torch.enable_grad():
        inputs = [_fake(mode, given.get(name)) for name in names]
        flags = _StageGradients(pipe.split_gm).flags(inputs)
    outputs: dict[int, frozenset[int]] = {}
    inputs_of: dict[int, frozenset[int]] = {}
    carrying: dict[Any, bool] = {}
    for i, call in enumerate(calls):
        inputs_of[i] = frozenset(
            k for k, arg in enumerate(call.args) if arg in carrying and not carrying[arg]
        )
        mine = flags[call.name]
        outputs[i] = frozenset(k for k, flag in enumerate(mine) if not flag)
        for user in call.users:
            carrying[user] = mine[user.args[1] if user.target is operator.getitem else 0]
    return Handovers(outputs, inputs_of)


def _fake(mode: Any, value: Any) -> Any:
    return mode.from_tensor(value) if isinstance(value, torch.Tensor) else value


class _StageGradients(torch.fx.Interpreter):
    """Runs a split graph whole, recording per stage call whether each output it returns
    needs a gradient."""

    def flags(self, inputs: list[Any]) -> dict[str, list[bool]]:
        self._flags: dict[str, list[bool]] = {}
        self.run(*inputs)
        return self._flags

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        result = super().call_module(target, args, kwargs)
        returned = result if isinstance(result, tuple | list) else (result,)
        self._flags[self._current] = [
            isinstance(v, torch.Tensor) and v.requires_grad for v in returned
        ]
        return result

    def run_node(self, n: Any) -> Any:
        self._current = n.name
        return super().run_node(n)


def keep_constants_without_gradient(stage: Any, handovers: Handovers) -> None:
    """A built stage neither waits for a gradient of the values it hands on that carry none
    nor computes one for such values it receives (:func:`constant_handovers`): both ends
    read the same table, so the backward's sends and receives stay paired."""
    outputs = handovers.outputs.get(stage.stage_index, frozenset())
    inputs = handovers.inputs.get(stage.stage_index, frozenset())
    send_info, recv_info = stage._create_act_send_info, stage._create_act_recv_info

    def sends() -> Any:
        info = send_info()
        metas = list(stage._stage_meta.outputs)
        for k in outputs:
            metas[k] = dataclasses.replace(metas[k], requires_grad=False)
        stage._stage_meta.outputs = tuple(metas)
        return info

    def receives() -> Any:
        infos = recv_info()
        for k in inputs:
            info = infos[k]
            if info.buffer is not None:
                info.buffer.requires_grad_(False)
                info.tensor_meta = dataclasses.replace(info.tensor_meta, requires_grad=False)
        return infos

    if outputs:
        stage._create_act_send_info = sends
    if inputs:
        stage._create_act_recv_info = receives


def stage_module(stage: Any) -> nn.Module:
    """The module a built stage runs (original parameter names)."""
    return stage.submod


def defer_weight_pass(stage: Any, builder: Callable[[], Callable[[], None]]) -> None:
    """Give a built stage its own weight-gradient pass for the zero-bubble schedules (torch's
    ``dw_builder``, which ``pipe.build_stage`` takes no argument for): the stage then runs each
    micro-batch's backward through autograd whole, calls ``builder()`` right after it, and
    keeps the runner it returns for the schedule's weight action (or calls it at once for a
    full backward), instead of splitting the backward through the autograd graph."""
    stage.dw_builder = builder


def make_schedule(
    name: str,
    stages: list[Any],
    micro_batches: int,
    loss_fn: Callable[..., torch.Tensor],
    merge: tuple[Any, ...] | None = None,
) -> Any:
    """A schedule over this rank's stages; gradients are scaled by 1/micro_batches (the loss
    of a step is the mean of its micro-batches' losses); ``merge`` (:func:`output_merge`)
    says how the last stage's outputs of the micro-batches merge for ``job.predict``."""
    cls = SCHEDULES[name]
    first = stages[0] if name in ("gpipe", "1f1b") else stages
    return cls(first, micro_batches, loss_fn=loss_fn, scale_grads=True, output_merge_spec=merge)


def output_merge(pipe: Any, micro_batches: int) -> tuple[Any, ...] | None:
    """How the micro-batches' outputs of ``pipe``'s last stage merge into the batch's: along
    the batch dim (torch's default), but a scalar (a loss computed inside the model) by the
    mean over micro-batches (the batch's loss, micro-batches being equal); None where no
    output is a scalar."""
    calls = [n for n in pipe.split_gm.graph.nodes if n.op == "call_module"]
    last = pipe.split_gm.get_submodule(calls[-1].target)
    out = next(n for n in last.graph.nodes if n.op == "output")
    returned = out.args[0] if isinstance(out.args[0], tuple | list) else (out.args[0],)
    values = [getattr(node, "meta", {}).get("val") for node in returned]
    if not any(isinstance(v, torch.Tensor) and v.ndim == 0 for v in values):
        return None
    mean = custom_reducer(0.0, lambda total, x: total + x / micro_batches)
    return tuple(
        mean if isinstance(v, torch.Tensor) and v.ndim == 0 else TensorChunkSpec(0) for v in values
    )


def run_schedule(
    schedule: Any, stages: list[Any], args: tuple[Any, ...], kwargs: dict[str, Any],
    target: torch.Tensor, *, forward_only: bool = False, outputs: list[Any] | None = None,
) -> list[torch.Tensor]:  # fmt: skip
    """One step of the schedule (``forward_only``: its forwards alone, for evaluation):
    inputs where the first stage runs, targets where the last does; returns the micro-batch
    losses this rank computed (none if not the last stage). With ``outputs`` (forward only),
    the last stage's outputs, merged over micro-batches, are appended to it."""
    first = any(s.is_first for s in stages)
    last = any(s.is_last for s in stages)
    losses: list[torch.Tensor] = []
    inputs = args if first else ()
    run = schedule.eval if forward_only else schedule.step
    extra = {} if forward_only else {"return_outputs": False}
    merged = run(
        *inputs,
        target=target if last else None,
        losses=losses if last else None,
        **extra,
        **(kwargs if first else {}),
    )
    if outputs is not None and last:
        outputs.append(merged)
    return losses


def mean_over_group(tensors: Sequence[torch.Tensor], group: Any, size: int) -> None:
    """Average ``tensors`` in place over ``group`` (one flat all-reduce)."""
    if size == 1 or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    flat /= size
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n


def shard_stage(
    module: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    reshard_after_forward: bool,
    whole: Sequence[nn.Parameter],
    gather_dtype: torch.dtype | None = None,
) -> None:
    """Optimizer parallel over the data-parallel sub-mesh for one stage, by FSDP2
    (``fully_shard``): parameters, gradients and optimizer states split over ``dp_mesh``;
    parameters gathered before the stage's forward and (with ``reshard_after_forward``,
    ZeRO-3) again before its backward; gradients reduce-scattered (averaged) once, after the
    last micro-batch (torch's pipeline stage tells FSDP which backward is the last). ``whole``
    parameters stay whole on every rank (MindSpore's size threshold and exclusions): their
    gradients are the caller's to average. Parameters already DTensors on a tensor-parallel
    sub-mesh of the same mesh are split over both (FSDP2's 2-D composition).
    ``gather_dtype`` (bf16 training): parameters are gathered in it (half the traffic) and
    gradients reduced in fp32 (FSDP2's mixed precision policy)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=gather_dtype, reduce_dtype=torch.float32)
    fully_shard(
        module,
        mesh=dp_mesh,
        reshard_after_forward=reshard_after_forward,
        ignored_params=set(whole) or None,
        mp_policy=policy if gather_dtype is not None else MixedPrecisionPolicy(),
    )


def dp_shard_mesh(device_mesh: DeviceMesh, dp_axis: str, shard_size: int | None) -> DeviceMesh:
    """The mesh FSDP2 shards a stage over: the dp sub-mesh, or under HSDP
    (``optimizer_weight_shard_size``) the dp axis cut into a 2-D (replicate, shard) mesh,
    FSDP2's hybrid sharding: shards in groups of ``shard_size`` consecutive dp ranks,
    gradients reduce-scattered inside a group and all-reduced across the groups."""
    dp = int(device_mesh[dp_axis].size())
    if shard_size is None or shard_size == dp:
        return device_mesh[dp_axis]
    names = (f"{dp_axis}_replicate", f"{dp_axis}_shard")
    cut = unflatten_mesh_dim(device_mesh, dp_axis, (dp // shard_size, shard_size), names)
    return cut[names]


def sum_over_group(value: torch.Tensor, group: Any) -> torch.Tensor:
    """``value`` summed over ``group`` (a new tensor)."""
    out = value.clone()
    dist.all_reduce(out, group=group)
    return out


def start_sum_over_world(value: torch.Tensor) -> Callable[[], torch.Tensor]:
    """Start summing ``value`` over every rank (the step's loss from the last stages); the
    returned function waits and gives the sum. Started early, its latency hides behind the
    gradient reduction and the optimizer step every rank runs anyway."""
    out = value.clone()
    work = dist.all_reduce(out, async_op=True)

    def wait() -> torch.Tensor:
        work.wait()
        return out

    return wait


def stage_on_submesh(module: nn.Module, device_mesh: DeviceMesh, *, planned: bool = False) -> None:
    """Run ``module`` (a stage whose parameters are already DTensors on ``device_mesh``, the
    mesh of the axes inside a stage) on DTensors: its tensor inputs enter replicated over
    ``device_mesh`` and its outputs leave whole (a pending sum reduced, a split gathered), so
    the pipeline's sends, receives and loss see the plain tensors one device would. Gradients
    flow through both conversions. The module's ``forward`` is wrapped in place (its
    parameter names stay the model's).

    ``planned``: the stage's ops have their inputs laid out as a plan says
    (:mod:`plait.runtime.pipeline.planned_stage`), which reduces each pending sum where and
    as the plan does (a reduce-scatter where the reader takes it split: sequence parallel);
    otherwise every op's pending sum is all-reduced at once (:class:`_PendingSumsReduced`)."""
    from plait.comm.dispatch import PlaitDispatchMode
    from plait.comm.dtensor import implicit_replication

    inner = module.forward

    def enter(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
            return DTensor.from_local(x, device_mesh, [Replicate()] * device_mesh.ndim)
        return x

    def leave(y: Any) -> Any:
        return y.full_tensor() if isinstance(y, DTensor) else y

    def forward(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = tree_map(enter, (args, kwargs))
        with implicit_replication(), PlaitDispatchMode(), _PendingSumsReduced(forward=not planned):
            out = inner(*args, **kwargs)
        return tree_map(leave, out)

    module.forward = forward  # type: ignore[method-assign]


class _PendingSumsReduced(TorchFunctionMode):
    """Every op's pending-sum output is reduced at once (Megatron's all-reduce right after a
    row-parallel linear). Left pending, DTensor reduces it where the next norm reads it, but
    autograd keeps the unreduced value for that norm's backward, which reduces it again.

    The same in backward: the gradient of an op's replicated output is reduced where it
    arrives as a pending sum (Megatron's all-reduce of a column-parallel input's gradient,
    at the norm's output). Left pending, DTensor carries it on through ops whose backward is
    linear in the gradient (``rms_norm``'s, unlike ``layer_norm``'s, and the residual adds)
    down to a row-parallel weight, whose gradient then comes out a whole-sized pending sum
    (its activation all-gathered for it), and to a vocabulary-split embedding, whose backward
    cannot take one (DTensor refuses a sum into its masked partial).

    ``forward=False``: forward pending sums are left to the plan's layouts (a planned stage's
    readers reduce them as the plan says); the backward's are still reduced."""

    def __init__(self, *, forward: bool = True) -> None:
        super().__init__()
        self.forward = forward

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if (
            self.forward
            and isinstance(out, DTensor)
            and any(p.is_partial() for p in out.placements)
        ):
            whole = [Replicate() if p.is_partial() else p for p in out.placements]
            out = out.redistribute(out.device_mesh, whole)
        if (
            isinstance(out, DTensor)
            and out.requires_grad
            and not out.is_leaf  # an op that returns a parameter itself: its sum stays pending
            and torch.is_grad_enabled()
            and all(p.is_replicate() for p in out.placements)
        ):
            # a hook, not an op: a traced stage's forward graph stays as it was
            out.register_hook(_pending_sum_reduced)
        return out


def _pending_sum_reduced(grad: Any) -> Any:
    """A replicated value's gradient, a pending sum in it all-reduced (anything else is left
    as it is: no collective where no sum is pending)."""
    if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
        whole = [Replicate() if p.is_partial() else p for p in grad.placements]
        return grad.redistribute(grad.device_mesh, whole)
    return None


# ------------------------------------------------------------ stages laid out as planned

PlacementCode = tuple[str, ...]
"""One placement per axis of a stage's mesh, ``"<axis>=R"`` or ``"<axis>=S<dim>"`` (``"tp=S2"``):
an FX graph's constant argument (:mod:`plait.runtime.pipeline.planned_stage`)."""


def lay_out(x: Any, code: PlacementCode) -> Any:
    """``x`` redistributed to the placements ``code`` names, on its own device mesh when that
    is the mesh ``code`` names (the stage's); a plain tensor, or a DTensor on another mesh
    (optimizer parallel's data-parallel one), as it is."""
    if not isinstance(x, DTensor):
        return x
    axes = tuple(c.partition("=")[0] for c in code)
    if tuple(x.device_mesh.mesh_dim_names or ()) != axes:
        return x
    want = tuple(
        Replicate() if p == "R" else Shard(int(p[1:])) for p in (c.partition("=")[2] for c in code)
    )
    if tuple(x.placements) == want:
        return x
    if isinstance(x, nn.Parameter):
        return x.redistribute(x.device_mesh, want)
    # One activation read by several ops wanting one layout (a block's input, by its norm and
    # by its residual add, in two modules' graphs) is moved once, as the plan moves it: the
    # moved value is kept on the activation itself, for as long as it lives and is unchanged
    # (its version counter: an in-place op since moves it again). Not a parameter's: it
    # changes between steps.
    moved = x.__dict__.setdefault("_plait_laid_out", {})
    key = (code, x._version)
    if key not in moved:
        # the greedy planner, as the plan's executor moves values: a pending sum to a split
        # is one reduce-scatter (DTensor's min-cost search may take an all-reduce and a slice)
        with greedy_redistribution_planning():
            moved[key] = x.redistribute(x.device_mesh, want)
    return moved[key]


# ------------------------------------------------------------ a stage as a per-rank program


@dataclass(frozen=True)
class PieceLayout:
    """How a local piece makes a DTensor: its device mesh, placements, global shape and
    stride (a compiled stage's parameters and gradients, :mod:`plait.runtime.pipeline.stage_program`)."""

    mesh: DeviceMesh
    placements: tuple[Any, ...]
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    spec: Any = field(compare=False, repr=False)
    """DTensor's own metadata of it (its ``_spec``)."""

    @classmethod
    def of(cls, tensor: DTensor) -> PieceLayout:
        return cls(
            tensor.device_mesh,
            tuple(tensor.placements),
            tuple(tensor.shape),
            tensor.stride(),
            tensor._spec,
        )

    def dtensor(self, piece: torch.Tensor) -> DTensor:
        """``piece`` as the DTensor of this layout (no communication, no copy)."""
        return DTensor.from_local(
            piece, self.mesh, self.placements, run_check=False, shape=torch.Size(self.shape),
            stride=self.stride,
        )  # fmt: skip


def layout_of(tensor: torch.Tensor) -> PieceLayout | None:
    """A DTensor's :class:`PieceLayout`; None for a plain tensor."""
    return PieceLayout.of(tensor) if isinstance(tensor, DTensor) else None


def parameter_from_piece(
    piece: torch.Tensor, layout: PieceLayout, grad_layout: Callable[[PieceLayout], None]
) -> DTensor:
    """``piece`` as the DTensor parameter it is this rank's piece of, inside a traced stage.
    Unlike ``DTensor.from_local``, whose backward redistributes the gradient to the piece's
    layout (a pending sum reduced on every micro-batch), the gradient leaves as the local
    piece of the layout backward gave it, a pending sum still pending (the job reduces it once
    a step, as the eager stage's parameters' gradients); that layout goes to ``grad_layout``
    when the backward is traced."""
    return _FromPiece.apply(piece, layout, grad_layout)  # type: ignore[no-any-return]


class _FromPiece(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, piece: torch.Tensor, layout: PieceLayout, grad_layout: Any) -> DTensor:
        ctx.grad_layout = grad_layout
        ctx.placements = layout.placements
        return DTensor(piece.view_as(piece), layout.spec, requires_grad=piece.requires_grad)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        if grad is None:
            return None, None, None
        # laid out as the parameter, but for a pending sum where the parameter is whole (the
        # job reduces it once a step): a whole gradient of a split parameter (a vocabulary-split
        # embedding's, computed whole from a whole output gradient) is cut to this rank's piece
        wanted = tuple(
            g if g.is_partial() and p.is_replicate() else p
            for g, p in zip(grad.placements, ctx.placements, strict=True)
        )
        if wanted != tuple(grad.placements):
            grad = grad.redistribute(grad.device_mesh, wanted)
        ctx.grad_layout(PieceLayout.of(grad))
        return grad._local_tensor, None, None


def add_piece_to_grad(
    param: torch.Tensor, piece: torch.Tensor, layout: PieceLayout, *, copy: bool = False
) -> None:
    """Add a local gradient ``piece`` (laid out as ``layout``) into ``param.grad``: on the
    local piece when the gradient there is laid out alike (no DTensor dispatch), else
    through DTensor. A first gradient is kept as it is, or copied (``copy``: it may alias
    something else; or its strides are not the parameter piece's, as autograd's gradient
    accumulation copies it)."""
    grad = param.grad
    if grad is None:
        with torch.no_grad():
            local = param.to_local() if isinstance(param, DTensor) else param
            if copy or (piece.shape == local.shape and piece.stride() != local.stride()):
                piece = torch.empty_like(local if piece.shape == local.shape else piece).copy_(
                    piece
                )
        param.grad = layout.dtensor(piece)
    elif isinstance(grad, DTensor) and tuple(grad.placements) == layout.placements:
        grad._local_tensor.add_(piece)
    else:
        param.grad = grad + layout.dtensor(piece)
