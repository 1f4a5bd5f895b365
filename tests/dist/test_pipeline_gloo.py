"""Pipeline parallel on real gloo processes: pp=2 x dp=2 on 4 workers equals one device.

Two spawns (a spawn costs ~15 s): the default suite's (:func:`_workers`, about 95 s here) and
a nightly one (:func:`_nightly_workers`, about 90 s) with the legs named below that the
default one leaves out (gpipe and zero_bubble on pp x dp, recompute auto, selective and per
module, fp16, offload, zero bubble with tp, the host optimizer beside compiled stages, mode
auto's ZeRO-3 cut). Together they train a 4-layer TinyGPT for 2 SGD steps under every CPU
schedule (gpipe, 1f1b, interleaved_1f1b with 2 stages a rank, zero_bubble, and zero_bubble_v's
V: stages 0 and 3 on one rank, 1 and 2 on the other, handed over in memory), each from the
same weights and batches: every step's loss and the final parameters equal single-device
training. A model whose LM head is its token embedding (one tensor read by the first and the
last stage) trains as one device does. One run cuts the stages where ``plait.pipeline_stage`` marks say instead of evenly; one
recomputes every stage's forward in its backward (``recompute="full"``), one takes the planner's
choice (``recompute="auto"`` under a limit nothing fits: full). fp16 runs with dynamic loss
scaling: an overflowing step is skipped on every rank, then training equals one device under
the same autocast and scale. Offload in the stages: the optimizer's states on the host (alone
and with ZeRO-2) and the activations backward reads on the host (zero bubble, and ZeRO-3),
each equal to one device; the host optimizer's checkpoint resumes its job bit for bit, loads
into a pipeline without offload bit for bit, and that job's back into ZeRO-2 with offload.
pp=2 x tp=2 runs its stages as compiled programs on 1f1b and on zero bubble (each stage's
backward cut into an input-gradient graph and a weight-gradient graph the schedule runs
later; the V with tp, nightly), equal to one device with Megatron's tp all-reduces counted. Evaluation runs the stages' forwards alone; ``job.predict`` returns the whole batch's logits on every rank. The collectives of a step are counted (point-to-point sends and receives, the data-parallel
gradient mean, the loss), so a silent extra one fails. Then a pipeline job's checkpoint (each rank writes its own stage) loads into plain data
parallel on dp=4 and back into the pipeline: both continue exactly as the single device does.

SGD, not Adam: a wrong gradient scale (micro-batches summed instead of averaged, a missing
data-parallel mean) shows in the parameters.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

import plait
from plait import ParallelConfig
from plait._compat import TorchDispatchMode, group_ranks
from plait.comm.dtensor import is_dtensor, local_piece
from plait.models import GPTConfig, TinyGPT, annotate_megatron, gpt_loss
from plait.testing import run_workers
from plait.testing.comm import CollectiveLog
from plait.testing.equivalence import Run, reference_run

pytestmark = pytest.mark.dist

CFG = GPTConfig(vocab=32, seq=8, width=16, heads=4, layers=4)
STEPS = 2
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zero_bubble_v")
PIPE = {"mode": "data_parallel", "mesh": {"pp": 2, "dp": 2}, "micro_batches": 4}
PP_TP = ParallelConfig(mode="semi_auto", mesh={"pp": 2, "tp": 2}, micro_batches=4)


class ProcessGroupLog(TorchDispatchMode):
    """Counts the process-group ops (send, recv, all-reduce...) dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.dtypes: Counter[tuple[str, torch.dtype]] = Counter()
        """(op, dtype of its first tensor argument) for each collective."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional"):
            self.counts[func._opname] += 1
            leaves = torch.utils._pytree.tree_leaves((args, kwargs or {}))
            first = next((a for a in leaves if isinstance(a, torch.Tensor)), None)
            if first is not None:
                self.dtypes[(func._opname, first.dtype)] += 1
        return func(*args, **(kwargs or {}))


class DTensorOps(TorchDispatchMode):
    """Counts the ops dispatched on DTensors while active (DTensor still runs them)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            self.counts[str(func)] += 1
            return NotImplemented
        return func(*args, **(kwargs or {}))


def _program(job) -> dict:
    """What a job's compiled stages ran: micro-batches, functional collectives in their
    graphs, and whether every graph input and value is a plain (local) tensor."""
    out: dict = {"calls": [], "collectives": Counter(), "local": True}
    for program in job.stage_programs:
        out["calls"].append(program.calls)
        for graph in (program.forward, program.backward):
            for node in graph.graph.nodes:
                target = str(node.target)
                if target.startswith("_c10d_functional."):
                    out["collectives"][target] += 1
                out["local"] &= not isinstance(node.meta.get("val"), DTensor)
    return out


def _planned_against_ran(job) -> list[tuple[int, dict, dict]]:
    """Per stage this rank runs: the tp collectives the plan lists for the ops of that
    stage, by (phase, kind), a micro-batch's worth; and those the compiled stage's forward
    and backward graphs issue, by the same key."""
    plan = job.plan
    stage_of = {name: k for k, names in enumerate(plan.stages) for name in names}
    out = []
    for index, program in zip(job.stage_indices, job.stage_programs, strict=True):
        planned = Counter()
        for c in plan.collectives:
            if c.axes == ("tp",) and stage_of.get(c.op) == index:
                planned[(c.phase, c.kind)] += c.count
        ran = Counter()
        for phase, graph in (("forward", program.forward), ("backward", program.backward)):
            for target, n in _collectives(graph).items():
                if not target.endswith("wait_tensor.default"):
                    kind = target.removeprefix("_c10d_functional.").removesuffix(".default")
                    ran[(phase, kind)] += n
        out.append((index, dict(planned), dict(ran)))
    return out


def _collectives(graph) -> dict:
    """The functional collectives in an FX graph, by op."""
    targets = (str(n.target) for n in graph.graph.nodes)
    return dict(Counter(t for t in targets if t.startswith("_c10d_functional.")))


def _sgd(params):
    return torch.optim.SGD(params, lr=0.5)


def _model(marked: bool = False, tied: bool = False, megatron: bool = False) -> TinyGPT:
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    if megatron:
        annotate_megatron(model, 2)
    if tied:  # the LM head is the token embedding: stage 0 and the last stage share it
        model.head.weight = model.tok.weight
    if marked:  # stage 0: embeddings and block 0; stage 1: blocks 1-3 and the head
        plait.pipeline_stage(model.blocks[0], 0)
        for block in model.blocks[1:]:
            plait.pipeline_stage(block, 1)
    return model


def _batches(n: int = STEPS):
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, CFG.vocab, (8, CFG.seq), generator=gen)
        out.append((ids, torch.roll(ids, -1, dims=1)))
    return out


def _local(job, batch):
    if "dp" not in job.mesh.axis_names:
        return batch
    dp = job.device_mesh.get_coordinate()[job.mesh.axis_index("dp")]
    size = job.mesh.axis_size("dp")
    return tuple(x.chunk(size)[dp] for x in batch)


def _momentum(params):
    """SGD with momentum: a state per parameter, for the offloaded optimizer to keep."""
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def _train(
    config: ParallelConfig, marked: bool = False, tied: bool = False, megatron=False,
    optimizer=_sgd, min_offload_bytes: int | None = None,
):  # fmt: skip
    """Two steps. ``min_offload_bytes``: activation offload's threshold (the tiny model's
    values are all under the 1 MiB default, so the offload legs move everything)."""
    batches = _batches()
    job = plait.parallelize(
        _model(marked, tied, megatron), config, optimizer=optimizer, loss_fn=gpt_loss,
        example_batch=batches[0],
    )  # fmt: skip
    if min_offload_bytes is not None:
        job.activation_offload.min_bytes = min_offload_bytes
    losses = [job.step(_local(job, b)) for b in batches]
    return job, losses


def _saved_tensors(job) -> int:
    """Tensors a step keeps for backward outside recomputed regions (a third step)."""
    count = [0]

    def pack(t):
        count[0] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        job.step(_local(job, _batches()[0]))
    return count[0]


def _held_bytes(job) -> tuple[int, int, int]:
    """Parameter bytes the user's model still holds storage for, its stages' (local pieces),
    and the whole model's."""
    model = list(job.model.parameters())
    held = sum(p.untyped_storage().nbytes() for p in model)
    stages = {id(p): p for m in job.stage_modules for p in m.parameters()}
    local = sum(local_piece(p).untyped_storage().nbytes() for p in stages.values())
    return held, local, sum(p.numel() * p.element_size() for p in model)


def _zero_bubble_tp_leg(out: dict, schedule: str) -> None:
    """pp=2 x tp=2 on a zero-bubble schedule, Megatron annotations: 2 steps, then a third
    whose tp collectives are counted; each stage's split graphs and the measured passes."""
    config = ParallelConfig(mode="semi_auto", mesh={"pp": 2, "tp": 2}, micro_batches=4,
                            schedule=schedule)  # fmt: skip
    job, losses = _train(config, megatron=True)
    with CollectiveLog(job.inner_mesh) as inner:
        job.step(_batches()[0])  # a third step
    graphs = [
        (index, p.calls, p.weight_calls, _collectives(p.backward_input),
         _collectives(p.backward_weight))
        for index, p in zip(job.stage_indices, job.stage_programs, strict=True)
    ]  # fmt: skip
    events = sorted(job.timeline().events, key=lambda e: (e.rank, e.start_s))
    passes = [(e.rank, e.kind, e.stage, e.micro_batch) for e in events]
    # (a later mesh of the same shape may name its tp group by number: resolved)
    counts = {
        (kind, tuple(group_ranks(axis)) if axis.isdigit() else axis): n
        for (kind, axis), n in inner.counts().items()
    }
    out[("pp_tp", schedule)] = (losses, job.full_state_dict(), counts, graphs, passes)


DEFAULT_SCHEDULES = ("1f1b", "interleaved_1f1b", "zero_bubble_v")
"""The schedules the default suite's spawn runs on pp=2 x dp=2 (the other two: nightly)."""


def _schedule_legs(out: dict, schedules: tuple[str, ...]) -> None:
    for schedule in schedules:
        job, losses = _train(ParallelConfig(**PIPE, schedule=schedule))
        out[schedule] = (losses, job.full_state_dict())
        if schedule == "1f1b":
            out["saved_plain"] = _saved_tensors(job)
            out["held_plain"] = _held_bytes(job)
        if schedule == "zero_bubble_v":  # a third step, on the first batch again
            with ProcessGroupLog() as log:
                job.step(_local(job, _batches()[0]))
            out["v_collectives"] = (dict(log.counts), job.stage_indices)


def _nightly_workers(root: str) -> dict:
    """The legs the default suite's spawn leaves out (:func:`_workers`): the other two
    schedules, recompute auto, selective and per module, fp16, offload, zero bubble with tp
    in the stages, the host optimizer beside compiled stages, and mode auto's ZeRO-3 cut."""
    out: dict = {}
    _schedule_legs(out, ("1f1b", *(s for s in SCHEDULES if s not in DEFAULT_SCHEDULES)))
    # recompute="auto": nothing fits 1 KiB, so the planner's last resort, full recompute
    job, losses = _train(ParallelConfig(**PIPE, recompute="auto", memory_limit="1KiB"))
    out["recompute_auto"] = (losses, job.full_state_dict(), job.config.recompute)
    job, losses = _train(ParallelConfig(**PIPE, recompute="selective", schedule="gpipe"))
    out["selective"] = (losses, job.full_state_dict())
    per_module = {"blocks.0": "full", "blocks.3": "selective"}  # one in each stage
    job, losses = _train(ParallelConfig(**PIPE, recompute_modules=per_module))
    out["per_module"] = (losses, job.full_state_dict())
    out["saved_per_module"] = _saved_tensors(job)
    _offload_legs(out, root)
    # fp16 with dynamic loss scaling: steps at a sane scale; then a step at a scale that
    # overflows is skipped on every rank (scale halved, parameters untouched)
    batches = _batches()
    fp16 = plait.parallelize(
        _model(), ParallelConfig(**PIPE, precision="fp16"), optimizer=_sgd, loss_fn=gpt_loss,
        example_batch=batches[0],
    )  # fmt: skip
    fp16.loss_scaler.scale = 1024.0
    losses = [fp16.step(_local(fp16, b)) for b in batches]
    state = fp16.full_state_dict()
    fp16.loss_scaler.scale = 2.0**40
    with ProcessGroupLog() as log:
        fp16.step(_local(fp16, batches[0]))
    unchanged = all(torch.equal(v, fp16.full_state_dict()[k]) for k, v in state.items())
    skipped = (fp16.loss_scaler.skipped_steps, fp16.loss_scaler.scale, dict(log.counts))
    out["fp16"] = (losses, state, skipped, unchanged)
    # zero bubble with tp in the stages (2 stages of one block a rank): each compiled
    # stage's backward cut into an input-gradient graph and a weight-gradient graph run
    # later, at the schedule's weight action (the V: the 8-process test, nightly too)
    _zero_bubble_tp_leg(out, "zero_bubble")
    # the optimizer on the host beside compiled stages (their gradients reach its copies)
    host = ParallelConfig(mode="semi_auto", mesh={"pp": 2, "tp": 2}, micro_batches=4,
                          offload="optimizer")  # fmt: skip
    built: list[int] = []

    def counted(params):  # the user's factory: called once to check its class, once to build
        built.append(1)
        return _momentum(params)

    job, losses = _train(host, megatron=True, optimizer=counted)
    out["pp_tp_host"] = (losses, job.full_state_dict(), [p.calls for p in job.stage_programs])
    out["factory_calls"] = len(built)
    auto = ParallelConfig(mode="auto", mesh={"pp": 2, "dp": 2}, optimizer_shard=3,
                          optimizer_shard_threshold=0, recompute="full")  # fmt: skip
    job, losses = _train(auto)
    out["auto_zero3"] = (losses, job.full_state_dict(), job.stage_starts)
    return out


def _workers(root: str) -> dict:
    """The default suite's legs (the rest: :func:`_nightly_workers`)."""
    out: dict = {}
    _schedule_legs(out, DEFAULT_SCHEDULES)
    job, losses = _train(ParallelConfig(**PIPE, recompute="full"))
    out["recompute"] = (losses, job.full_state_dict())
    job, losses = _train(ParallelConfig(**PIPE), tied=True)
    out["tied"] = (losses, job.full_state_dict())
    job, losses = _train(ParallelConfig(**PIPE), marked=True)
    out["marked"] = (losses, job.full_state_dict(), job.stage_starts)
    with ProcessGroupLog() as log:  # a third step, on the first batch again
        job.step(_local(job, _batches()[0]))
    out["collectives"] = dict(log.counts)
    # optimizer parallel in the stages (FSDP2 over dp): ZeRO-3 on the interleaved schedule
    # with the head tied to the embedding; ZeRO-1 with small parameters kept whole
    job, losses = _train(
        ParallelConfig(**PIPE, schedule="interleaved_1f1b", optimizer_shard=3,
                       optimizer_shard_threshold=0), tied=True,
    )  # fmt: skip
    out["zero3_tied"] = (losses, job.full_state_dict())
    out["held_zero3"] = _held_bytes(job)
    # pretrained weights into FSDP2's shards, the tie's two stage copies from one name
    job.load_pretrained(Path(root) / "tied.safetensors")
    out["pretrained_zero3"] = job.full_state_dict()
    job, losses = _train(
        ParallelConfig(**PIPE, optimizer_shard=1, optimizer_shard_threshold="1KiB")
    )
    state = job.full_state_dict()
    bf16, bf16_losses = _train(
        ParallelConfig(**PIPE, precision="bf16", optimizer_shard=2, optimizer_shard_threshold=0)
    )
    dtypes = {p.dtype for m in bf16.stage_modules for p in m.parameters()}
    out["bf16_zero2"] = (bf16_losses, bf16.full_state_dict(), dtypes)
    with ProcessGroupLog() as log:  # a third step: parameters gathered in bf16
        bf16.step(_local(bf16, _batches()[0]))
    out["bf16_collectives"] = (dict(log.dtypes), dict(log.counts))
    with ProcessGroupLog() as log:  # a third step, on the first batch again
        job.step(_local(job, _batches()[0]))
    out["zero1"] = (losses, state, dict(log.counts), len(job._dp_averaged))
    # tensor parallel inside the stages: pp=2 x tp=2, Megatron annotations, mode semi_auto
    job, losses = _train(PP_TP, megatron=True)
    with CollectiveLog(job.inner_mesh) as inner, ProcessGroupLog() as log, DTensorOps() as ops:
        job.step(_batches()[0])  # a third step (tp x pp: every rank takes the whole batch)
    out["pp_tp"] = (losses, job.full_state_dict(), job.predict((_batches()[0][0],)))
    out["pp_tp_collectives"] = (inner.counts(), dict(log.counts))
    params = sum(1 for m in job.stage_modules for _ in m.parameters())
    out["pp_tp_program"] = (_program(job), dict(ops.counts), params)
    # (after pp_tp's count: a later mesh of the same shape renames its groups) plans of
    # mode auto with pipeline stages run as pipelines: the plan's stage split,
    # micro-batches, ZeRO level and recompute; its parameter layouts inside the stages
    auto = ParallelConfig(mode="auto", mesh={"pp": 2, "tp": 2}, search="dynamic_programming")
    job, losses = _train(auto, megatron=True)
    params = [p for m in job.stage_modules for p in m.parameters()]
    split = sum(is_dtensor(p) and p.placements[0].is_shard() for p in params)
    out["auto_pp_tp"] = (losses, job.full_state_dict(), split, job.config.micro_batches)
    out["auto_pp_tp_collectives"] = (_planned_against_ran(job), job.plan_mismatches)
    job.load_pretrained(Path(root) / "untied.safetensors")  # into the stages' tp pieces
    out["pretrained_pp_tp"] = job.full_state_dict()
    job, losses = _train(ParallelConfig(**PIPE), marked=True)  # back to 2 steps
    out["evaluate"] = job.evaluate(_local(job, _batches()[0]))
    out["predict"] = job.predict((_batches()[0][0],))  # the whole batch, the same everywhere
    try:  # the stages are built for the training batch: another size is refused by name
        job.predict((_batches()[0][0][:4],))
        out["predict_refused"] = ""
    except plait.ShardingError as e:
        out["predict_refused"] = str(e)
    png = Path(root) / "measured.png"
    timeline = job.timeline(png, trace=Path(root) / "measured.json")
    out["timeline"] = sorted({(e.rank, e.kind) for e in timeline.events})
    report = job.report()  # every rank: it gathers the same pass times as job.timeline()
    out["report_timeline"] = (report.measured_timeline == timeline, report.predicted_timeline)
    # a pipeline checkpoint -> plain data parallel -> back into a pipeline (ZeRO-2 stages)
    batches = _batches(STEPS + 2)
    job.save(Path(root) / "pipe")
    flat = plait.parallelize(
        _model(), ParallelConfig(mode="data_parallel", mesh={"dp": 4}), optimizer=_sgd,
        loss_fn=gpt_loss,
    )  # fmt: skip
    assert flat.load(Path(root) / "pipe") == STEPS
    third = flat.step(_local(flat, batches[STEPS]))
    flat.save(Path(root) / "flat")
    again = plait.parallelize(  # into the pipeline with ZeRO-2 in its stages
        _model(), ParallelConfig(**PIPE, optimizer_shard=2, optimizer_shard_threshold=0),
        optimizer=_sgd, loss_fn=gpt_loss, example_batch=batches[0],
    )  # fmt: skip
    assert again.load(Path(root) / "flat") == STEPS + 1
    fourth = again.step(_local(again, batches[STEPS + 1]))
    out["reshard"] = ([third, fourth], again.full_state_dict())
    return out


def _offload_legs(out: dict, root: str) -> None:
    """Offload in the stages. The optimizer on the host (SGD with momentum, a state per
    parameter): alone and with ZeRO-2 (FSDP2's shards); the optimizer must update host
    copies (ZeroOptimizer's shadows), not the stages' parameters; their checkpoints
    (:func:`_offload_checkpoints`). Activations saved for
    backward on the host: on the zero-bubble schedule (its input- and weight-gradient passes
    read them apart) and with ZeRO-3 (FSDP2 frees and gathers the parameters forward saves);
    a third step under outer saved-tensor hooks sees nothing: every saved tensor went through
    the offload's hooks."""
    zero2 = {"optimizer_shard": 2, "optimizer_shard_threshold": 0}
    host = {}
    for name, extra in (("offload_optimizer", {}), ("offload_optimizer_zero2", zero2)):
        job, losses = _train(ParallelConfig(**PIPE, offload="optimizer", **extra),
                             optimizer=_momentum)  # fmt: skip
        zero = job.optimizer._plait_shadows
        updated = {id(p) for g in job.optimizer.param_groups for p in g["params"]}
        states = [t for s in job.optimizer.state.values() for t in s.values()]
        wiring = (
            type(zero).__name__,
            updated == {id(s) for s in zero.shadows},
            not updated & {id(p) for m in job.stage_modules for p in m.parameters()},
            len(states) == len(updated),
            {t.device.type for t in states},
        )
        out[name] = (losses, job.full_state_dict(), wiring)
        host[name] = job
    out["offload_checkpoints"] = _offload_checkpoints(
        host["offload_optimizer"], host["offload_optimizer_zero2"], Path(root)
    )
    zero3 = {"optimizer_shard": 3, "optimizer_shard_threshold": 0}
    for name, extra in (("offload_activations_zb", {"schedule": "zero_bubble"}),
                        ("offload_activations_zero3", zero3)):  # fmt: skip
        job, losses = _train(
            ParallelConfig(**PIPE, offload="activations", **extra), min_offload_bytes=0
        )
        moved = (job.activation_offload.moved, job.activation_offload.moved_bytes)
        state = job.full_state_dict()
        out[name] = (losses, state, moved, _saved_tensors(job))


def _offload_checkpoints(host, host_zero2, root: Path) -> dict:
    """Checkpoints of a pipeline whose optimizer is on the host, after its 2 steps (SGD with
    momentum: the states must travel). Saved, a third step taken, loaded back into the same
    job and the third step taken again: the same loss and parameters, bit for bit (as if it
    had not stopped). The same checkpoint into a pipeline without offload: its third step
    the same, bit for bit. That job's checkpoint after the third step into the ZeRO-2
    pipeline with the optimizer on the host (FSDP2's shards), and a fourth step. (Each step
    of 4 processes costs about a second on 2 cores: 4 steps here, one job built.)"""
    batches = _batches(STEPS + 2)
    third, fourth = batches[STEPS], batches[STEPS + 1]
    host.save(root / "host")
    go_on = (host.step(_local(host, third)), host.full_state_dict())
    loaded = host.load(root / "host")
    again = (host.step(_local(host, third)), host.full_state_dict())
    plain = plait.parallelize(
        _model(), ParallelConfig(**PIPE), optimizer=_momentum, loss_fn=gpt_loss,
        example_batch=batches[0],
    )  # fmt: skip
    loaded_plain = plain.load(root / "host")
    plain_third = (plain.step(_local(plain, third)), plain.full_state_dict())
    plain.save(root / "no_offload")
    loaded_zero2 = host_zero2.load(root / "no_offload")
    zero2_fourth = host_zero2.step(_local(host_zero2, fourth))
    return {
        "steps": (loaded, loaded_plain, loaded_zero2),
        "resumed": (go_on, again),
        "into_plain": plain_third,
        "fourth_zero2": ([plain_third[0], zero2_fourth], host_zero2.full_state_dict()),
    }


def _check_offload(results: list[dict]) -> None:
    """Offload legs equal one device (fp32; the same tolerance as every leg here: the
    micro-batches' gradients are summed in another order than one device's batch); each
    rank's optimizer updates host copies holding one momentum state each (on this CPU
    machine the host is the device: the wiring is what is checked); the host optimizer's
    checkpoints continue bit for bit where the plan is the same but for offload, and as one
    device into ZeRO-2; each rank's stages moved saved tensors to the host, and none was
    saved past the offload's hooks."""
    momentum = reference_run(_model(), gpt_loss, _momentum, _batches())
    longer = reference_run(_model(), gpt_loss, _momentum, _batches(STEPS + 2))
    longer = Run(longer.losses[STEPS:], longer.state)  # steps 3 and 4, the final state
    short = reference_run(_model(), gpt_loss, _sgd, _batches())
    for rank, r in enumerate(results):
        # checkpoints of the optimizer on the host: back into the same job exactly, into a
        # pipeline without offload exactly, and back with ZeRO-2 as one device
        ck = r["offload_checkpoints"]
        assert ck["steps"] == (STEPS, STEPS, STEPS + 1), (rank, ck["steps"])
        (go_on, go_on_state), resumed = ck["resumed"]
        for name, (loss, state) in (("resumed", resumed), ("into_plain", ck["into_plain"])):
            assert loss == go_on, (name, rank, loss, go_on)
            assert state.keys() == go_on_state.keys()
            for key, value in go_on_state.items():
                assert torch.equal(state[key], value), (name, rank, key)
        _same_run(*ck["fourth_zero2"], longer, f"offload checkpoint to ZeRO-2 rank {rank} ")
        for name in ("offload_optimizer", "offload_optimizer_zero2"):
            losses, state, wiring = r[name]
            _same_run(losses, state, momentum, f"{name} rank {rank} ")
            assert wiring == ("ZeroOptimizer", True, True, True, {"cpu"}), (name, rank, wiring)
        for name in ("offload_activations_zb", "offload_activations_zero3"):
            losses, state, (moved, nbytes), saved_past = r[name]
            _same_run(losses, state, short, f"{name} rank {rank} ")
            assert moved > 0 and nbytes > 0 and saved_past == 0, (name, rank, moved, saved_past)


def _autocast_reference(
    model: TinyGPT, batches: list, dtype: torch.dtype = torch.bfloat16, scale: float = 1.0
) -> Run:
    """One device, SGD, every forward and loss under ``torch.autocast`` with ``dtype``; the
    loss multiplied by ``scale`` before backward and the gradients divided after (fp16)."""
    optimizer = _sgd(model.parameters())
    losses = []
    for batch in batches:
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            loss = gpt_loss(model, batch)
        (loss * scale).backward()
        for p in model.parameters():
            p.grad.div_(scale)
        optimizer.step()
        losses.append(loss.item())
    return Run(losses, {k: v.detach().clone() for k, v in model.state_dict().items()})


def _check_fp16(results: list[dict]) -> None:
    """fp16: one device under the same autocast and loss scale, to fp16's tolerance; the
    overflowing step skipped everywhere, its scale halved, one all-reduce per mesh axis (pp,
    dp) agreeing on it beside the step's usual sends, receives, gradient mean and loss."""
    reference = _autocast_reference(_model(), _batches(), torch.float16, 1024.0)
    for rank, r in enumerate(results):
        losses, state, skipped, unchanged = r["fp16"]
        assert skipped[:2] == (1, 2.0**39) and unchanged, (rank, skipped)
        counts = {k: skipped[2].get(k, 0) for k in ("send", "recv_", "allreduce_", "all_reduce")}
        assert counts == {"send": 4, "recv_": 4, "allreduce_": 2, "all_reduce": 2}, (rank, counts)
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(reference.losses), rtol=2e-2, atol=2e-3
        )
        for key, value in reference.state.items():
            torch.testing.assert_close(state[key], value, rtol=2e-2, atol=2e-3, msg="fp16 " + key)


def _same_run(losses: list[float], state: dict, reference, name: str) -> None:
    """Losses and parameters equal one device's (fp32, SGD)."""
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference.losses), msg=name)
    for key, value in reference.state.items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=name + key)


def _pretrained_file(path: Path, tied: bool) -> dict[str, torch.Tensor]:
    """Weights unlike the model's (each tensor once moved by noise; a tie saved under both
    names, as torch saves it), written to ``path``; returns them."""
    gen = torch.Generator().manual_seed(7)
    moved: dict[int, torch.Tensor] = {}
    state = {}
    for name, value in _model(tied=tied).state_dict(keep_vars=True).items():
        if id(value) not in moved:
            moved[id(value)] = value.detach() + 0.25 * torch.randn(value.shape, generator=gen)
        state[name] = moved[id(value)]
    save_file({k: v.clone() for k, v in state.items()}, str(path))
    return state


def _check_pretrained(results: list[dict], pretrained: dict[str, dict]) -> None:
    """Every rank's stages hold the file's values after ``job.load_pretrained``."""
    for rank, r in enumerate(results):
        for leg, expected in pretrained.items():
            assert r[leg].keys() == expected.keys(), (rank, leg)
            for key, value in expected.items():
                torch.testing.assert_close(r[leg][key], value, rtol=0, atol=0, msg=leg + key)


def test_pipeline_schedules_and_checkpoints_equal_one_device(tmp_path: Path) -> None:
    pretrained = {
        "pretrained_zero3": _pretrained_file(tmp_path / "tied.safetensors", tied=True),
        "pretrained_pp_tp": _pretrained_file(tmp_path / "untied.safetensors", tied=False),
    }
    reference = reference_run(_model(), gpt_loss, _sgd, _batches(STEPS + 2))
    results = run_workers(_workers, 4, str(tmp_path), timeout_s=280.0)
    _check_pretrained(results, pretrained)
    short = reference_run(_model(), gpt_loss, _sgd, _batches())
    tied = reference_run(_model(tied=True), gpt_loss, _sgd, _batches())
    megatron_short = reference_run(_model(megatron=True), gpt_loss, _sgd, _batches())
    # every schedule, marks, recompute, ties and ZeRO-3; and mode auto's pipeline plans (with
    # Megatron annotations the plan splits parameters over tp inside the stages)
    for name, ref in [
        *((name, short) for name in (*DEFAULT_SCHEDULES, "marked", "recompute")),
        ("tied", tied), ("zero3_tied", tied), ("auto_pp_tp", megatron_short),
    ]:  # fmt: skip
        _same_run(*results[0][name][:2], ref, name)
    assert results[0]["marked"][2] == ["blocks.1"]
    for rank, r in enumerate(results):  # a rank holds its stage's parameters, not the model's
        held, local, whole = r["held_plain"]
        assert held == local and 0 < local < whole, (rank, r["held_plain"])
        held, local, whole = r["held_zero3"]  # FSDP2's shards: the whole tensors let go
        assert held == 0 and 0 < local < whole / 2, (rank, r["held_zero3"])
    # bf16 (with ZeRO-2): one device under the same torch.autocast, to bf16's tolerance (its
    # matmuls sum in another order when split); parameters stay fp32
    losses, state, dtypes = results[0]["bf16_zero2"]
    bf16 = _autocast_reference(_model(), _batches())
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(bf16.losses), rtol=2e-2, atol=2e-3
    )
    for key, value in bf16.state.items():
        torch.testing.assert_close(state[key], value, rtol=2e-2, atol=2e-3, msg="bf16 " + key)
    assert dtypes == {torch.float32}
    for rank, r in enumerate(results):  # gathered in bf16 (half the bytes), reduced in fp32
        seen = r["bf16_collectives"][0]
        gathers = {dtype for (op, dtype) in seen if op == "_allgather_base_"}
        scatters = {dtype for (op, dtype) in seen if op == "_reduce_scatter_base_"}
        assert gathers == {torch.bfloat16} and scatters == {torch.float32}, (
            rank,
            r["bf16_collectives"],
        )
    assert results[0]["auto_pp_tp"][2] > 0
    # ZeRO-1 (run as FSDP2's ZeRO-2): equal to one device; per step each rank gathers its
    # stage's sharded parameters once and reduce-scatters their gradients once; the gradients
    # of parameters under 1 KiB (norms, biases: kept whole) are averaged in one all-reduce,
    # beside the loss's
    for rank, r in enumerate(results):
        losses, state, counts, whole = r["zero1"]
        _same_run(losses, state, short, f"zero1 rank {rank}")
        assert whole > 0 and {k: counts[k] for k in ("send", "recv_")} == {"send": 4, "recv_": 4}
        assert (counts["_allgather_base_"], counts["_reduce_scatter_base_"]) == (1, 1), counts
        assert counts["allreduce_"] == 2, f"rank {rank}: {counts}"
    trained = _model()
    trained.load_state_dict(short.state)
    with torch.no_grad():
        expected = gpt_loss(trained.eval(), _batches()[0]).item()
    assert results[0]["evaluate"] == pytest.approx(expected, rel=1e-5)
    with torch.no_grad():
        logits = trained(_batches()[0][0])
    assert (
        "the batch has [4] rows but the stages were built for batches of [8]"
        in (results[0]["predict_refused"])
    )
    for rank, r in enumerate(results):  # every rank gets the whole batch's logits
        torch.testing.assert_close(r["predict"], logits, rtol=1e-5, atol=1e-6, msg=f"rank {rank}")
    # the last training step's measured schedule: both pipeline ranks ran forwards and
    # backwards; the picture is a PNG (its size in the header) and the trace is JSON
    assert results[0]["timeline"] == [
        (0, "backward"), (0, "forward"), (1, "backward"), (1, "forward")
    ]  # fmt: skip
    # job.report() holds the same measured timeline (report.plot draws it); marks: no plan
    assert all(r["report_timeline"] == (True, None) for r in results)
    png = (tmp_path / "measured.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(png[16:20], "big") > 100
    assert json.loads((tmp_path / "measured.json").read_text())["traceEvents"]
    _check_pipeline_collectives(results)
    # pp=2 x tp=2: equal to one device; every rank predicts the whole batch's logits
    megatron = reference_run(_model(megatron=True), gpt_loss, _sgd, [*_batches(), _batches()[0]])
    losses, state, logits = results[0]["pp_tp"]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(megatron.losses[:STEPS]))
    for key, value in megatron.state.items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg="pp_tp " + key)
    trained = _model()
    trained.load_state_dict(megatron.state)
    with torch.no_grad():
        torch.testing.assert_close(logits, trained.eval()(_batches()[0][0]), rtol=1e-5, atol=1e-6)
    # Per step of 4 micro-batches, each stage of 2 Megatron blocks (stage 1 also the final
    # norm and the head): the p2p and loss traffic of any pipeline, no dp mean (no dp axis),
    # and Megatron's tp all-reduces, 8 a micro-batch: forward one after each row-parallel
    # linear (reduced at once), backward one where the gradients of each pair of
    # column-parallel inputs meet (the norm before attention and before the MLP).
    for rank, r in enumerate(results):
        inner, pg = r["pp_tp_collectives"]
        assert inner == {("all_reduce", "tp"): 32}, f"rank {rank}: {inner}"
        assert {k: pg[k] for k in ("send", "recv_", "allreduce_")} == {
            "send": 4, "recv_": 4, "allreduce_": 1
        }, f"rank {rank}: {pg}"  # fmt: skip
        # ...issued by the stage's compiled program: one forward and one backward graph over
        # local tensors, traced once, that ran every micro-batch of the 3 steps and hold the
        # 8 all-reduces of a micro-batch as functional collectives. DTensor dispatched no op
        # of the stage's forward or backward: the step's only DTensor ops are the schedule's
        # 1/micro_batches scale of each gradient and SGD's update of each parameter (the
        # stage on DTensors dispatched about 1,450 ops a step here).
        program, ops, params = r["pp_tp_program"]
        assert program["calls"] == [12] and program["local"], f"rank {rank}: {program}"
        assert program["collectives"] == {
            "_c10d_functional.all_reduce.default": 8, "_c10d_functional.wait_tensor.default": 8
        }, f"rank {rank}: {program}"  # fmt: skip
        assert set(ops) == {"aten.div_.Tensor", "aten.add_.Tensor"}, f"rank {rank}: {ops}"
        assert max(ops.values()) <= params, f"rank {rank}: {ops}, {params} parameters"
    losses, state = results[0]["reshard"]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference.losses[STEPS:]))
    for key, value in reference.state.items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.nightly
def test_pipeline_schedules_precision_offload_and_recompute_equal_one_device(
    tmp_path: Path,
) -> None:
    """The legs the default suite's spawn leaves out (:func:`_nightly_workers`), each equal
    to one device: gpipe and zero_bubble on pp=2 x dp=2, recompute auto (full under a limit
    nothing fits), selective and per module (fewer tensors kept than 1f1b's), fp16 with
    dynamic loss scaling, offload of the optimizer and of activations (and their
    checkpoints), zero bubble with tp in the stages, the host optimizer beside compiled
    stages, and mode auto's ZeRO-3 cut."""
    results = run_workers(_nightly_workers, 4, str(tmp_path), timeout_s=280.0)
    short = reference_run(_model(), gpt_loss, _sgd, _batches())
    names = ("gpipe", "zero_bubble", "recompute_auto", "selective", "per_module", "auto_zero3")
    for name in names:
        _same_run(*results[0][name][:2], short, name)
    assert results[0]["recompute_auto"][2] == "full"
    assert results[0]["auto_zero3"][2] == ["blocks.2"]  # the planner's cut: 2 layers a stage
    for rank, r in enumerate(results):  # per-module recompute keeps fewer tensors, each stage
        assert r["saved_per_module"] < r["saved_plain"], (rank, r["saved_per_module"])
    _check_fp16(results)
    _check_offload(results)
    megatron = reference_run(_model(megatron=True), gpt_loss, _sgd, [*_batches(), _batches()[0]])
    _check_zero_bubble_tp(results, megatron, "zero_bubble")
    momentum = reference_run(_model(megatron=True), gpt_loss, _momentum, _batches())
    _same_run(*results[0]["pp_tp_host"][:2], momentum, "pp_tp_host")
    for rank, r in enumerate(results):
        assert r["pp_tp_host"][2] == [8], f"rank {rank}: {r['pp_tp_host'][2]}"
        # parallelize's check of the optimizer's class, then the one the job steps with
        assert r["factory_calls"] == 2, f"rank {rank}: {r['factory_calls']} factory calls"


def _check_pipeline_collectives(results: list[dict]) -> None:
    """Each rank, per step of 4 micro-batches over 2 stages: 4 activations or gradients sent
    and 4 received, one all-reduce of the stage's gradients over dp and one of the loss. The
    V (zero_bubble_v): pipeline rank 0 runs stages 0 and 3, rank 1 stages 1 and 2; the turn
    from stage 1 to stage 2 stays on rank 1, in memory. So 8 sends and 8 receives a step (the
    interleaved schedule's 4 stages on 2 ranks send 12), and none to itself."""
    for rank, r in enumerate(results):
        assert r["collectives"] == {"send": 4, "recv_": 4, "allreduce_": 2}, rank
        pp_rank = rank // 2  # mesh (pp, dp): pp is outermost
        expected = ({"send": 8, "recv_": 8, "allreduce_": 2}, [pp_rank, 3 - pp_rank])
        assert r["v_collectives"] == expected, (rank, r["v_collectives"])
    # What runs is what the plan says: each compiled stage of the searched pp=2 x tp=2 plan
    # issues, a micro-batch, exactly the tp collectives the plan lists for its ops (the
    # forward's all-reduces after the row-parallel products, the backward's where the
    # column-parallel inputs' gradients meet).
    for rank, r in enumerate(results):
        stages, mismatches = r["auto_pp_tp_collectives"]
        for index, planned, ran in stages:
            assert planned and planned == ran, (rank, index, planned, ran)
        assert mismatches == [], (rank, mismatches)  # the job's own check agrees


def _check_zero_bubble_tp(results: list[dict], megatron: Run, schedule: str) -> None:
    """A zero-bubble schedule on pp=2 x tp=2 (compiled stages, 2 a rank: interleaved,
    stages r and r + 2, in the default suite; the V, stages r and 3 - r, nightly): equal to
    one device; per step Megatron's 4 tp all-reduces a block and micro-batch (2 stages x 4
    micro-batches x 4); each stage's
    backward split: the input-gradient graph holds the all-reduces (the norms' input
    gradients), the weight-gradient graph none, except on the first stage, which has no input
    gradient, so its whole backward is the weight pass (as torch's own split); every
    micro-batch ran both graphs, and weight passes were deferred past other passes."""
    reduce = {"_c10d_functional.all_reduce.default": 2, "_c10d_functional.wait_tensor.default": 2}
    losses, state = results[0][("pp_tp", schedule)][:2]  # 2 steps, then the counted third
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(megatron.losses[:STEPS]))
    for key, value in megatron.state.items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=schedule + key)
    for rank, r in enumerate(results):
        counts, graphs, passes = r[("pp_tp", schedule)][2:]
        tp_peers = (rank - rank % 2, rank - rank % 2 + 1)  # mesh (pp, tp): tp innermost
        assert counts in ({("all_reduce", "tp"): 32}, {("all_reduce", tp_peers): 32}), (
            schedule, rank, counts,
        )  # fmt: skip
        pp_rank = rank // 2
        pair = [pp_rank, pp_rank + 2] if schedule == "zero_bubble" else [pp_rank, 3 - pp_rank]
        assert [g[0] for g in graphs] == pair, (schedule, rank, graphs)
        for index, calls, weight_calls, first, second in graphs:
            assert (calls, weight_calls) == (12, 12), (schedule, rank, graphs)
            expected = ({}, reduce) if index == 0 else (reduce, {})
            assert (first, second) == expected, (schedule, rank, graphs)
        kinds = {(pp, kind) for pp, kind, _, _ in passes}
        assert kinds == {(p, k) for p in (0, 1) for k in ("forward", "backward", "weight")}
        deferred = [
            (stage, mb) for i, (pp, kind, stage, mb) in enumerate(passes)
            if kind == "backward" and stage > 0
            and passes[i + 1 : i + 2] != [(pp, "weight", stage, mb)]
        ]  # fmt: skip
        assert deferred, (schedule, passes)  # a weight pass ran later than its backward


def _three_axes(_: str) -> dict:
    """pp=2 x dp=2 x tp=2 on 8 workers, every schedule (compiled stages; the zero-bubble ones
    split each backward), semi_auto Megatron: losses, the final parameters and the step's
    collectives; ZeRO-3, ZeRO-2 in bf16, HSDP and activation offload in the stages."""
    out = {}
    for schedule in SCHEDULES:
        config = ParallelConfig(
            mode="semi_auto", mesh={"pp": 2, "dp": 2, "tp": 2}, micro_batches=4,
            schedule=schedule,
        )  # fmt: skip
        job, losses = _train(config, megatron=True)
        out[schedule] = (losses, job.full_state_dict(), [p.calls for p in job.stage_programs])
        if schedule == "1f1b":
            one_f_one_b = job
    zero3 = ParallelConfig(
        mode="semi_auto", mesh={"pp": 2, "dp": 2, "tp": 2}, micro_batches=4,
        optimizer_shard=3, optimizer_shard_threshold=0,
    )  # fmt: skip
    zero_job, losses = _train(zero3, megatron=True)  # FSDP2 over dp of tp-split stages (2-D)
    out["zero3"] = (losses, zero_job.full_state_dict(), [p.calls for p in zero_job.stage_programs])
    # ZeRO-2 in bf16 (parameters gathered in bf16): tp stages on DTensors, op by op
    zero2 = ParallelConfig(
        mode="semi_auto", mesh={"pp": 2, "dp": 2, "tp": 2}, micro_batches=4,
        optimizer_shard=2, optimizer_shard_threshold=0, precision="bf16",
    )  # fmt: skip
    bf16_job, losses = _train(zero2, megatron=True)
    out["zero2_bf16"] = (
        losses, bf16_job.full_state_dict(), [p.calls for p in bf16_job.stage_programs],
    )  # fmt: skip
    hsdp = ParallelConfig(
        mode="semi_auto", mesh={"pp": 2, "dp": 4}, micro_batches=2,
        optimizer_shard=3, optimizer_shard_threshold=0, optimizer_weight_shard_size=2,
    )  # fmt: skip
    hsdp_job, losses = _train(hsdp)  # FSDP2's hybrid sharding: groups of 2 of dp=4
    sharded = [p for m in hsdp_job.stage_modules for p in m.parameters() if is_dtensor(p)]
    shards = (sum(local_piece(p).numel() for p in sharded), sum(p.numel() for p in sharded))
    out["hsdp"] = (losses, hsdp_job.full_state_dict(), shards)
    # activation offload with tp in the stages: DTensors saved for backward wait on the
    # host as their local pieces and come back as the same DTensors
    offload = ParallelConfig(
        mode="semi_auto", mesh={"pp": 2, "dp": 2, "tp": 2}, micro_batches=4,
        offload="activations",
    )  # fmt: skip
    offload_job, losses = _train(offload, megatron=True, min_offload_bytes=0)
    out["offload"] = (
        losses, offload_job.full_state_dict(), offload_job.activation_offload.moved,
        [p.calls for p in offload_job.stage_programs],
    )  # fmt: skip
    job = one_f_one_b
    with CollectiveLog(job.inner_mesh) as inner, ProcessGroupLog() as log:
        job.step(_local(job, _batches()[0]))
    # the 3-D mesh's sliced tp group may be named by number: resolve it to its ranks
    groups = {e.axis for e in inner.events}
    out["collectives"] = (
        {(kind, tuple(group_ranks(axis)) if axis.isdigit() else axis): n
         for (kind, axis), n in inner.counts().items()},
        {k: log.counts[k] for k in ("send", "recv_", "allreduce_")},
        sorted(groups),
    )  # fmt: skip
    return out


@pytest.mark.nightly
def test_pipeline_data_and_tensor_parallel_on_eight_processes(tmp_path: Path) -> None:
    """4-D minus one: the pipeline's stages replicated over dp and split over tp. Nightly: 8
    processes on a 2-core machine take about a minute."""
    results = run_workers(_three_axes, 8, str(tmp_path), timeout_s=600.0)
    expected = reference_run(_model(megatron=True), gpt_loss, _sgd, _batches())
    assert all(r["offload"][2] > 0 for r in results)  # every rank's stage moved some
    # every schedule ran each stage as its compiled program, every micro-batch of the 2
    # steps (interleaved and both zero bubbles: 2 stages a rank), activation offload too
    # (what the program saves goes to the host) and ZeRO (FSDP2 gathers the parameters
    # before the program's call and reduce-scatters after its backward)
    for r in results:
        assert [r[s][2] for s in SCHEDULES] == [[8], [8], [8, 8], [8, 8], [8, 8]], r
        assert r["zero3"][2] == r["offload"][3] == [8], r
        assert r["zero2_bf16"][2] == [], r  # FSDP2's bf16 gathers keep the eager stage
    bf16 = _autocast_reference(_model(megatron=True), _batches())
    for rank, r in enumerate(results):  # to bf16's tolerance, as the pp=2 x dp=2 bf16 leg
        losses, state = r["zero2_bf16"][:2]
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(bf16.losses), rtol=2e-2, atol=2e-3
        )
        for key, value in bf16.state.items():
            torch.testing.assert_close(state[key], value, rtol=2e-2, atol=2e-3, msg=f"{rank} {key}")
    for schedule in (*SCHEDULES, "zero3", "offload"):
        losses, state = results[0][schedule][:2]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected.losses))
        for key, value in expected.state.items():
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=schedule + key)
    # HSDP in the stages (pp=2 x dp=4, shard groups of 2): equal to one device, and each
    # rank holds half of a sharded parameter (not a quarter)
    plain = reference_run(_model(), gpt_loss, _sgd, _batches())
    for r in results:
        losses, state, shards = r["hsdp"]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(plain.losses))
        for key, value in plain.state.items():
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg="hsdp " + key)
        local, whole = shards  # this rank's stage: half of it (FSDP2 pads uneven dims)
        assert whole and abs(2 * local - whole) <= 0.1 * whole, shards
    for rank, r in enumerate(results):
        inner, pg, _ = r["collectives"]
        tp_peers = (rank - rank % 2, rank - rank % 2 + 1)  # mesh (pp, dp, tp): tp is innermost
        # each stage's gradients averaged over dp once (one fused all-reduce) besides the
        # loss's; Megatron's tp all-reduces as in the pp=2 x tp=2 case, on half the rows
        assert pg == {"send": 4, "recv_": 4, "allreduce_": 2}, f"rank {rank}: {pg}"
        count = 32
        assert inner in ({("all_reduce", "tp"): count}, {("all_reduce", tp_peers): count}), (
            f"rank {rank}: {inner}"
        )


def _tp_other_schedules(_: str) -> dict:
    """pp=2 x tp=2 on the schedules the 4-process test above leaves out (it runs 1f1b and
    zero bubble): gpipe, interleaved 1f1b and zero_bubble_v, compiled stages; and mixed precision on
    compiled stages: bf16 on zero bubble (its backward split) and fp16 on 1f1b with a
    loss scale, each with the dtypes its forward graphs hold; recompute on compiled stages,
    full on the V and selective on 1f1b, and per module on the V, with the bytes their
    forwards keep; activation offload beside selective recompute on zero bubble."""
    out = {}
    for schedule in ("gpipe", "interleaved_1f1b"):
        config = ParallelConfig(
            mode="semi_auto", mesh={"pp": 2, "tp": 2}, micro_batches=4, schedule=schedule
        )  # fmt: skip
        job, losses = _train(config, megatron=True)
        out[schedule] = (losses, job.full_state_dict(), [p.calls for p in job.stage_programs])
    _zero_bubble_tp_leg(out, "zero_bubble_v")
    for precision, schedule in (("bf16", "zero_bubble"), ("fp16", "1f1b")):
        config = ParallelConfig(
            mode="semi_auto", mesh={"pp": 2, "tp": 2}, micro_batches=4, schedule=schedule,
            precision=precision,
        )  # fmt: skip
        batches = _batches()
        job = plait.parallelize(
            _model(megatron=True), config, optimizer=_sgd, loss_fn=gpt_loss,
            example_batch=batches[0],
        )  # fmt: skip
        if job.loss_scaler is not None:
            job.loss_scaler.scale = 1024.0
        losses = [job.step(b) for b in batches]
        dtypes = sorted(
            {str(n.meta["val"].dtype) for p in job.stage_programs for n in p.forward.graph.nodes
             if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].is_floating_point()}
        )  # fmt: skip
        calls = [(p.calls, p.weight_calls, p.refused) for p in job.stage_programs]
        out[precision] = (losses, job.full_state_dict(), calls, dtypes)
    for recompute, schedule in (("full", "zero_bubble_v"), ("selective", "1f1b")):
        config = ParallelConfig(
            mode="semi_auto", mesh={"pp": 2, "tp": 2}, micro_batches=4, schedule=schedule,
            recompute=recompute,
        )  # fmt: skip
        job, losses = _train(config, megatron=True)
        programs = [(p.calls, p.saved_bytes, _collectives(p.forward), _collectives(p.backward))
                    for p in job.stage_programs]  # fmt: skip
        out[recompute] = (losses, job.full_state_dict(), programs)
    # per-module recompute on compiled stages, regions of the same pass: the V puts block 0
    # (full) and block 3 (selective) in the first and last stages, both on pp rank 0
    config = ParallelConfig(
        mode="semi_auto", mesh={"pp": 2, "tp": 2}, micro_batches=4, schedule="zero_bubble_v",
        recompute_modules={"blocks.0": "full", "blocks.3": "selective"},
    )  # fmt: skip
    job, losses = _train(config, megatron=True)
    programs = [(p.calls, p.recompute_modules, p.saved_bytes) for p in job.stage_programs]
    out["modules"] = (losses, job.full_state_dict(), programs)
    # activation offload with selective recompute on compiled zero-bubble stages: what each
    # program's autograd function saves goes to the host (every value, threshold 0)
    config = ParallelConfig(
        mode="semi_auto", mesh={"pp": 2, "tp": 2}, micro_batches=4, schedule="zero_bubble",
        recompute="selective", offload="activations",
    )  # fmt: skip
    job, losses = _train(config, megatron=True, min_offload_bytes=0)
    moved = job.activation_offload.moved
    out["offload"] = (
        losses, job.full_state_dict(), [p.calls for p in job.stage_programs], moved,
        _saved_tensors(job),
    )  # fmt: skip
    return out


@pytest.mark.nightly
def test_pipeline_tensor_parallel_schedules_precision_and_recompute(
    tmp_path: Path,
) -> None:
    """With the test above, pp=2 x tp=2 on 4 processes on every schedule, each equal to one
    device, every stage run as its compiled program for every micro-batch (interleaved: 2
    stages a rank; the V with its backward split as zero bubble's). Mixed precision on compiled stages: bf16 (zero bubble) and fp16 (1f1b,
    loss scale 1024) equal to one device under the same autocast and scale, to their
    tolerance; the graphs hold both widths (products narrowed, norms and softmax in fp32).
    Nightly: the default suite's 4-process test runs 1f1b and zero bubble."""
    results = run_workers(_tp_other_schedules, 4, str(tmp_path), timeout_s=300.0)
    expected = reference_run(_model(megatron=True), gpt_loss, _sgd, _batches())
    megatron = reference_run(_model(megatron=True), gpt_loss, _sgd, [*_batches(), _batches()[0]])
    _check_zero_bubble_tp(results, megatron, "zero_bubble_v")
    for rank, r in enumerate(results):
        calls = [r[s][2] for s in ("gpipe", "interleaved_1f1b")]
        assert calls == [[8], [8, 8]], (rank, calls)
        for schedule in ("gpipe", "interleaved_1f1b"):
            _same_run(*r[schedule][:2], expected, f"pp_tp {schedule} rank {rank} ")
    for precision, dtype, scale, compiled in (
        ("bf16", torch.bfloat16, 1.0, [(8, 8, None), (8, 8, None)]),
        ("fp16", torch.float16, 1024.0, [(8, 0, None)]),
    ):  # fmt: skip
        reference = _autocast_reference(_model(megatron=True), _batches(), dtype, scale)
        for rank, r in enumerate(results):
            losses, state, calls, dtypes = r[precision]
            assert calls == compiled, (precision, rank, calls)
            assert dtypes == sorted({str(dtype), "torch.float32"}), (precision, rank, dtypes)
            torch.testing.assert_close(
                torch.tensor(losses), torch.tensor(reference.losses), rtol=2e-2, atol=2e-3
            )
            for key, value in reference.state.items():
                torch.testing.assert_close(
                    state[key], value, rtol=2e-2, atol=2e-3, msg=f"{precision} {key}"
                )
    # recompute on compiled stages (full on the V, selective on 1f1b): equal to one device;
    # each stage's forward keeps fewer bytes for its backward; the tp all-reduces' results
    # are kept, not issued again: 2 all-reduces a block in each graph, as without recompute
    reduce = {"_c10d_functional.all_reduce.default": 2, "_c10d_functional.wait_tensor.default": 2}
    for recompute, stages in (("full", 2), ("selective", 1)):
        for rank, r in enumerate(results):
            losses, state, programs = r[recompute]
            _same_run(losses, state, expected, f"recompute {recompute} rank {rank} ")
            assert len(programs) == stages, (recompute, rank, programs)
            blocks = 2 // stages  # 4 blocks over 2 ranks' stages
            each = {k: v * blocks for k, v in reduce.items()}
            for calls, (before, after), forward, backward in programs:
                assert calls == 8 and 0 < after < before, (recompute, rank, programs)
                assert forward == each and backward == each, (recompute, rank, programs)
    # per-module recompute: equal to one device; the stages holding the named blocks keep
    # fewer bytes for backward, the others as many as without
    for rank, r in enumerate(results):
        losses, state, programs = r["modules"]
        _same_run(losses, state, expected, f"recompute_modules rank {rank} ")
        named = [(("blocks.0", "full"),), (("blocks.3", "selective"),)] if rank < 2 else [(), ()]
        assert [p[1] for p in programs] == named, (rank, programs)
        for calls, held, (before, after) in programs:
            assert calls == 8 and (after < before if held else after == before), (rank, programs)
    # offload beside selective recompute on compiled zero-bubble stages: equal to one device,
    # both stages compiled, values moved, and none saved past the offload's hooks (a third
    # step under outer saved-tensor hooks)
    for rank, r in enumerate(results):
        losses, state, calls, moved, saved_past = r["offload"]
        _same_run(losses, state, expected, f"offload rank {rank} ")
        assert calls == [8, 8] and moved > 0 and saved_past == 0, (rank, calls, moved, saved_past)
