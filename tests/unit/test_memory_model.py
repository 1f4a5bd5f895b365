"""The cost model's memory side: ZeRO model states, transformer and graph activations, and
pipeline in-flight micro-batches, against the published numbers in cost-model.md 2.iv/2.v."""

from __future__ import annotations

from fractions import Fraction

import pytest

from plait.config import ParallelConfig
from plait.cost import (
    CostError,
    MemoryBreakdown,
    MemoryModel,
    StateBytes,
    graph_activation_bytes,
    in_flight_micro_batches,
    model_state_memory,
    training_memory,
    transformer_activation_bytes,
)
from plait.cost.saved import Saved, aliases_input, saved_by
from plait.cost.step_memory import StageActivations, StepTrace, stage_states, step_peak
from plait.graph import GraphInput, OpGraph, OpNode, TensorMeta

GB = 1e9

# ------------------------------------------------------------------------------ ZeRO

# cost-model.md 2.iv: per-device model states in GB, mixed-precision Adam (K = 12); the 7.5B,
# N_d = 64 row is the ZeRO paper's Figure 1 (120, 31.4, 16.6, 1.9 GB).
ZERO_TABLE = [
    # params, N_d, DP, ZeRO-1, ZeRO-2, ZeRO-3
    (7.5e9, 1, 120, 120, 120, 120),
    (7.5e9, 4, 120, 52.5, 41.3, 30),
    (7.5e9, 16, 120, 35.6, 21.6, 7.5),
    (7.5e9, 64, 120, 31.4, 16.6, 1.88),
    (7.5e9, 256, 120, 30.4, 15.4, 0.47),
    (7.5e9, 1024, 120, 30.1, 15.1, 0.12),
    (128e9, 64, 2048, 536, 284, 32),
    (128e9, 1024, 2048, 513.5, 257.8, 2),
    (1e12, 64, 16000, 4187.5, 2218.8, 250),
    (1e12, 1024, 16000, 4011.7, 2013.7, 15.6),
]


@pytest.mark.parametrize(("params", "n_d", "dp", "z1", "z2", "z3"), ZERO_TABLE)
def test_zero_model_states_match_the_reference_table(
    params: float, n_d: int, dp: float, z1: float, z2: float, z3: float
) -> None:
    for level, expected in ((None, dp), (1, z1), (2, z2), (3, z3)):
        got = model_state_memory(
            int(params), shard_group=n_d, optimizer_shard=level, precision="bf16"
        )
        # The table rounds to the decimals it prints (0.12 stands for 0.1171875).
        decimals = len(str(expected).partition(".")[2])
        tolerance = 0.5 * 10**-decimals + 1e-9
        assert got.total / GB == pytest.approx(expected, abs=tolerance), (params, n_d, level)


def test_zero_paper_figure_1_exactly() -> None:
    psi = 7_500_000_000
    totals = [
        model_state_memory(psi, shard_group=64, optimizer_shard=level, precision="fp16").total
        for level in (None, 1, 2, 3)
    ]
    assert totals == [120 * 10**9, 31_406_250_000, 16_640_625_000, 1_875_000_000]


def test_zero_levels_shard_states_in_order() -> None:
    n = 1000
    base = model_state_memory(n, shard_group=4, precision="fp32")
    assert (base.parameters, base.gradients, base.optimizer) == (4000, 4000, 8000)
    z1 = model_state_memory(n, shard_group=4, optimizer_shard=1)
    assert (z1.parameters, z1.gradients, z1.optimizer) == (4000, 4000, 2000)
    z2 = model_state_memory(n, shard_group=4, optimizer_shard=2)
    assert (z2.parameters, z2.gradients, z2.optimizer) == (4000, 1000, 2000)
    z3 = model_state_memory(n, shard_group=4, optimizer_shard=3)
    assert (z3.parameters, z3.gradients, z3.optimizer) == (1000, 1000, 2000)
    # Uneven: the largest shard (ceil) is what a device holds.
    assert model_state_memory(10, shard_group=4, optimizer_shard=3).parameters == 3 * 4
    # plait's runtime keeps fp32 parameters under autocast: override the accounting.
    runtime = model_state_memory(n, precision="bf16", state_bytes=StateBytes(4, 4, 8))
    assert runtime.total == base.total == 16 * n


def test_model_state_memory_rejects_bad_knobs() -> None:
    with pytest.raises(CostError, match="optimizer_shard=4"):
        model_state_memory(10, optimizer_shard=4)
    with pytest.raises(CostError, match="shard_group=0"):
        model_state_memory(10, shard_group=0)
    with pytest.raises(CostError, match="precision 'int8'"):
        model_state_memory(10, precision="int8")
    with pytest.raises(CostError, match="param_numel=-1"):
        model_state_memory(-1)


# ----------------------------------------------------------------------- activations

# GPT-3 175B (Korthikanti et al.): a = 96, s = 2048, h = 12288, so 5 a s / h = 80.
S, B, H, A = 2048, 1, 12288, 96
SBH = S * B * H


def _gpt3(**kw: object) -> int:
    return transformer_activation_bytes(seq=S, micro_batch=B, hidden=H, heads=A, **kw)  # type: ignore[arg-type]


def test_korthikanti_formulas_per_layer() -> None:
    t = 8
    assert _gpt3() == SBH * (34 + 80)
    assert _gpt3(tensor_parallel=t) == SBH * 10 + SBH * 24 // t + SBH * 80 // t
    assert _gpt3(tensor_parallel=t, sequence_parallel=True) == SBH * (34 + 80) // t
    assert _gpt3(tensor_parallel=t, recompute="selective") == SBH * 10 + SBH * 24 // t
    assert _gpt3(tensor_parallel=t, sequence_parallel=True, recompute="selective") == (
        34 * SBH // t
    )
    assert _gpt3(recompute="full") == 2 * SBH
    assert _gpt3(tensor_parallel=t, recompute="full") == 2 * SBH
    # Sequence parallelism splits the stored layer input too.
    assert _gpt3(tensor_parallel=t, sequence_parallel=True, recompute="full") == 2 * SBH // t


def test_selective_recompute_saves_70_percent_for_gpt3() -> None:
    # "selective recompute removes 70% / 65% of activation memory" (GPT-3 / MT-NLG).
    full = _gpt3(tensor_parallel=8, sequence_parallel=True)
    selective = _gpt3(tensor_parallel=8, sequence_parallel=True, recompute="selective")
    assert 1 - selective / full == pytest.approx(0.70, abs=0.005)
    mtnlg = {"seq": 2048, "micro_batch": 1, "hidden": 20480, "heads": 128, "tensor_parallel": 8}
    ratio = transformer_activation_bytes(
        **mtnlg, sequence_parallel=True, recompute="selective"
    ) / transformer_activation_bytes(**mtnlg, sequence_parallel=True)
    assert 1 - ratio == pytest.approx(0.65, abs=0.005)


def test_activation_itemsize_and_layers() -> None:
    # fp32 activations: (16 e + 2) s b h + (2 e + 1) a s^2 b with e = 4, masks stay 1 byte.
    s, b, h, a = 128, 2, 64, 4
    got = transformer_activation_bytes(seq=s, micro_batch=b, hidden=h, heads=a, itemsize=4)
    assert got == 66 * s * b * h + 9 * a * s * s * b
    many = transformer_activation_bytes(seq=s, micro_batch=b, hidden=h, heads=a, layers=12)
    assert many == 12 * transformer_activation_bytes(seq=s, micro_batch=b, hidden=h, heads=a)
    with pytest.raises(CostError, match="recompute='some'"):
        transformer_activation_bytes(seq=s, micro_batch=b, hidden=h, heads=a, recompute="some")  # type: ignore[arg-type]


# -------------------------------------------------------------------------- pipeline


def test_in_flight_micro_batches_per_schedule() -> None:
    assert [in_flight_micro_batches(i, 4, 8) for i in range(4)] == [4, 3, 2, 1]
    assert [in_flight_micro_batches(i, 4, 2) for i in range(4)] == [2, 2, 2, 1]
    assert [in_flight_micro_batches(i, 4, 8, "gpipe") for i in range(4)] == [8] * 4
    # Interleaved, stage 0: p (1 + (p - 1) / (p v)).
    p, v = 4, 2
    assert in_flight_micro_batches(0, p, 16, "interleaved_1f1b", chunks=v) == p * (
        1 + Fraction(p - 1, p * v)
    )
    assert in_flight_micro_batches(0, p, 16, "interleaved_1f1b", chunks=1) == 4
    assert in_flight_micro_batches(3, p, 16, "zero_bubble_v") == 4
    with pytest.raises(CostError, match="stage=4"):
        in_flight_micro_batches(4, 4, 8)


def test_first_1f1b_stage_holds_all_layers_worth_whatever_p() -> None:
    # Korthikanti: stage 0 holds p micro-batches x L/p layers = L layers' activations.
    layers = 24
    per_layer = _gpt3(tensor_parallel=8, sequence_parallel=True)
    for p in (1, 2, 4, 8):
        model = MemoryModel(stages=p, micro_batches=32)
        stage_acts = per_layer * layers // p
        assert model.breakdown(0, activation_bytes=stage_acts).activations == per_layer * layers


# -------------------------------------------------------------------- the whole model


def test_training_memory_adds_activations_in_flight() -> None:
    m = training_memory(1000, precision="fp32", activation_bytes=100, in_flight=3)
    assert m == MemoryBreakdown(parameters=4000, gradients=4000, optimizer=8000, activations=300)
    assert m.total == 16_300
    assert m.as_dict() == {
        "parameters": 4000,
        "gradients": 4000,
        "optimizer": 8000,
        "activations": 300,
    }
    half = training_memory(0, activation_bytes=3, in_flight=Fraction(1, 2))
    assert half.activations == 2  # rounded up


def test_memory_model_from_config() -> None:
    cfg = ParallelConfig(
        mesh={"pp": 2, "dp": 4, "tp": 2},
        pipeline_stages=2,
        micro_batches=8,
        optimizer_shard=3,
        precision="bf16",
        recompute="selective",
    )
    model = MemoryModel.from_config(cfg)
    assert (model.shard_group, model.optimizer_shard, model.stages) == (4, 3, 2)
    got = model.breakdown(4000, activation_bytes=10, stage=0)
    assert got.as_dict() == {
        "parameters": 2000,
        "gradients": 2000,
        "optimizer": 12000,
        "activations": 20,  # 1F1B stage 0 of 2 holds 2 micro-batches
    }
    assert model.breakdown(4000, activation_bytes=10, stage=1).activations == 10
    with pytest.raises(CostError, match="schedule='pipedream'"):
        MemoryModel(schedule="pipedream")  # type: ignore[arg-type]


# -------------------------------------------------------------------- from the graph


def _in(layer: str) -> dict[str, str]:
    return {"layer": layer, "module_path": layer}


def _two_layer_graph() -> OpGraph:
    f32 = TensorMeta((4, 8))  # 128 bytes
    w = TensorMeta((8, 8))
    ops = [
        OpNode("linear", "aten.linear.default", ("x", "w0"), (f32, w), (f32,), **_in("blocks.0")),
        OpNode("view", "aten.view.default", ("linear",), (f32,), (f32,), **_in("blocks.0")),
        OpNode("softmax", "aten._softmax.default", ("view",), (f32,), (f32,), **_in("blocks.0")),
        OpNode(
            "linear_1",
            "aten.linear.default",
            ("softmax", "w1"),
            (f32, w),
            (f32,),
            **_in("blocks.1"),
        ),
        OpNode("gelu", "aten.gelu.default", ("linear_1",), (f32,), (f32,), **_in("blocks.1")),
        OpNode("sum", "aten.sum.default", ("gelu",), (f32,), (TensorMeta(()),)),
    ]
    inputs = (
        GraphInput("x", "input", f32, "batch[0]"),
        GraphInput("w0", "parameter", w, "blocks.0.weight"),
        GraphInput("w1", "parameter", w, "blocks.1.weight"),
    )
    return OpGraph(inputs=inputs, ops=tuple(ops), outputs=("sum",))


def test_graph_activation_bytes_by_recompute_policy() -> None:
    graph = _two_layer_graph()
    # What autograd saves: linear the batch tensor x (held anyway: not counted), softmax its
    # output (which linear_1 saves too: one buffer), gelu its input (linear_1's output); the
    # view nothing; plus the scalar loss the step returns.
    assert graph_activation_bytes(graph) == 2 * 128 + 4
    # Selective keeps matmul results: linear_1's output stays, softmax is blocks.0's output.
    assert graph_activation_bytes(graph, recompute="selective") == 2 * 128 + 4
    # Full: blocks.1 recomputes linear_1 from softmax, the output of blocks.0 it reads.
    assert graph_activation_bytes(graph, recompute="full") == 128 + 4
    # Per-device pieces: a layout splitting every activation over 4 devices.
    quarter = graph_activation_bytes(graph, local_bytes=lambda ref: graph.meta(ref).nbytes // 4)
    assert quarter == 2 * 32 + 1


# -------------------------------------------------------------------- what backward keeps


def _op(target: str, inputs: tuple[str, ...], *metas: TensorMeta, **kw) -> OpNode:
    return OpNode("op", target, inputs, metas[: len(inputs)], metas[len(inputs) :], **kw)


def test_saved_by_follows_the_derivative_formulas() -> None:
    x, w = TensorMeta((4, 8)), TensorMeta((8, 8))
    linear = _op("aten.linear.default", ("x", "w"), x, w, x)
    assert saved_by(linear, [True, True]) == (Saved(0), Saved(1))
    assert saved_by(linear, [True, False]) == (Saved(1),)  # frozen weight: no input kept
    assert saved_by(linear, [False, False]) == ()  # nothing needs a gradient
    softmax = _op("aten._softmax.default", ("x",), x, x)
    assert saved_by(softmax, [True]) == (Saved(0, output=True),)
    assert saved_by(_op("aten.gelu.default", ("x",), x, x), [True]) == (Saved(0),)
    assert saved_by(_op("aten.add.Tensor", ("x", "y"), x, x, x), [True, True]) == ()
    assert saved_by(_op("aten.div.Tensor", ("x",), x, x), [True]) == ()  # by a number
    assert saved_by(_op("aten.view.default", ("x",), x, x), [True]) == ()
    assert aliases_input("aten.transpose.int") and aliases_input("aten.add_.Tensor")
    assert not aliases_input("aten.add.Tensor")
    norm = _op("aten.layer_norm.default", ("x", "w"), x, TensorMeta((8,)), x, args=(None, [8]))
    # the input, and a float32 mean and rstd per row of 8 floats
    assert saved_by(norm, [True, True]) == (Saved(0), Saved(0, ratio=Fraction(8, 32)))
    dropout = _op("aten.dropout.default", ("x",), x, x, args=(None, 0.1, True))
    assert saved_by(dropout, [True]) == (Saved(0, ratio=Fraction(1, 4)),)  # a byte per element
    off = _op("aten.dropout.default", ("x",), x, x, args=(None, 0.1, False))
    assert saved_by(off, [True]) == ()


def test_a_gpt_keeps_korthikantis_count_without_dropout() -> None:
    """Korthikanti et al. (2022), section 4: a GPT layer keeps sbh (34 + 5 as/h) bytes in
    fp16 with dropout; without dropout's two masks, its output and the attention's mask,
    16 sbh + as^2 b elements (each layer norm's input, the QKV input, Q, K, V, the
    projection's input, the MLP's input, both 4h tensors, the softmax), here in fp32 and
    plus layer norm's float32 statistics; outside the layers, the final norm's input,
    statistics and output, the loss's log-probabilities, the position ids and the loss."""
    import torch

    from plait.graph import capture
    from plait.models import GPTConfig, TinyGPT, gpt_loss

    s, b, h, a, v, layers = 16, 4, 32, 4, 64, 3
    with torch.device("meta"):
        model = TinyGPT(GPTConfig(vocab=v, seq=s, width=h, heads=a, layers=layers))
        ids = torch.zeros(b, s, dtype=torch.long)
    graph = capture(model, (ids, ids), gpt_loss)
    per_layer = 4 * (16 * s * b * h + a * s * s * b) + 2 * 2 * 4 * s * b
    outside = 4 * s * b * h * 2 + 2 * 4 * s * b + 4 * s * b * v + 8 * s + 4
    assert graph_activation_bytes(graph) == layers * per_layer + outside
    # full recompute: each layer's input, the final norm's working set, the loss's
    full = graph_activation_bytes(graph, recompute="full")
    assert full == layers * 4 * s * b * h + outside


def _stage(points, **kw) -> StageActivations:
    base = dict(
        inputs=0, kept=100, forward_peak=120, forward_gathered=0, points=points, gradients=40,
        bucket=0, largest_whole=1, largest_split=0,
    )  # fmt: skip
    return StageActivations(**{**base, **kw})


def test_the_peak_is_the_largest_moment_not_the_sum_of_the_kinds() -> None:
    states = stage_states(
        sharded_numel=0, whole_numel=10, frozen_numel=0, shard_group=1, optimizer_shard=None,
        precision="fp32",
    )  # fmt: skip
    assert (states.parameters, states.gradients, states.optimizer) == (40, 40, 80)
    # start of backward: 130 activation bytes, no gradient yet; at the end, every gradient
    # (40) and the bucket's flat copy (40) with 10 bytes of activations
    act = _stage(((130, 0, 0, 0, 0, 0), (10, 40, 0, 40, 0, 0)))
    peak = step_peak(act, states, optimizer_shard=None, shard_group=1, in_flight=1, micro_batches=1)
    assert (peak.peak, peak.when, peak.activations) == (40 + 80 + 130, "backward", 130)
    assert peak.gradients == 40  # held after the step
    assert peak.peak < states.total + act.kept  # the old sum: 160 + 100
    # a pipeline stage with two micro-batches in flight: the other keeps its 100 / 2; from the
    # second backward on, every gradient is in .grad (autograd adds into it in place)
    two = step_peak(
        act, states, optimizer_shard=None, shard_group=1, in_flight=2, micro_batches=2,
        accumulation="in_place",
    )  # fmt: skip
    assert (two.when, two.activations) == ("backward", 50 + 65)
    assert two.peak == 40 + 80 + 40 + 115


def test_zero_levels_hold_gradients_whole_until_their_bucket_is_reduced() -> None:
    # one bucket of 400 gradient bytes, split by ZeRO; at its reduction: the whole
    # gradients, the flat copy and (ZeRO-2/3) the 1/4 shard the reduce-scatter returns
    act = _stage(((10, 0, 0, 0, 0, 400), (0, 400, 0, 400, 400, 0)), bucket=400, largest_split=100)
    kw = dict(sharded_numel=100, whole_numel=0, frozen_numel=0, shard_group=4, precision="fp32")
    for level, extra in [(1, 400), (2, 400 + 100), (3, 400 + 100)]:
        states = stage_states(optimizer_shard=level, **kw)
        peak = step_peak(
            act, states, optimizer_shard=level, shard_group=4, in_flight=1, micro_batches=1
        )
        held = states.parameters + states.optimizer
        reduction = held + 400 + extra
        assert peak.peak >= reduction, level
    # ZeRO-3: the start of backward holds the gathered bucket and the flat copy of its shard
    states = stage_states(optimizer_shard=3, **kw)
    peak = step_peak(act, states, optimizer_shard=3, shard_group=4, in_flight=1, micro_batches=1)
    start = states.parameters + states.optimizer + 10 + 400 + 100
    assert peak.peak == max(start, states.parameters + states.optimizer + 900)


def test_offloaded_values_leave_the_device_until_their_backward() -> None:
    graph = _two_layer_graph()
    trace = StepTrace(graph)

    def walk(offload_min: int | None) -> StageActivations:
        (stage,) = trace.walk(
            value_bytes=lambda ref: graph.meta(ref).nbytes,
            read_bytes=lambda i, j: graph.ops[i].input_metas[j].nbytes,
            stage_of=[0] * len(graph.ops),
            stages=1,
            param_numel={"w0": 64, "w1": 64},
            buckets=[()],
            state_bytes=StateBytes(4, 4, 8),
            offload_min=offload_min,
        )
        return stage

    kept, moved = walk(None), walk(100)
    assert (kept.kept, moved.kept) == (2 * 128 + 4, 4)  # softmax, linear_1's output, the loss
    # brought back for backward: at the start of backward gelu's input is on the device again
    assert moved.points[0][0] >= 128
    assert kept.gradients == moved.gradients == 2 * 64 * 4
