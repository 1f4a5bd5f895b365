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
