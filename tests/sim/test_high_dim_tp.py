"""High-dimensional tensor parallel and dims split over several axes in any order (#32 item 3).

MindSpore's 2-D tensor parallel (its page "High-dimensional tensor parallel") splits each
matmul's weight over two axes x and y, one per dim, and keeps the activations between the
matmuls split over both: before a matmul the activation is all-gathered in y, after it the
partial sums are reduce-scattered in x (and the next matmul, whose weight is laid out the other
way round, swaps the roles). In plait that is two annotations a module: the weight's layout and
the layout its output leaves in (``out_strategy``), which the plan reaches by a reduce-scatter
and its readers read. The hidden activation then leaves split over ``(y, x)``: y first, against
mesh order, which the catalogue's strategies (mesh order only) list once an annotation names it
(:func:`plait.search.constraints.with_orders`).

Each case: semi_auto's plan on simulated ranks trains equal to one device (fp32, SGD so that a
wrong gradient scale shows; rtol 1e-4), and the collectives one step issues (plait's log by
kind, axis and bytes, and CommDebugMode's counts) equal the plan's list exactly.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import plait
from plait import Layout, ParallelConfig
from plait.errors import ShardingError
from plait.graph import capture_program
from plait.layout import TensorLayout
from plait.mesh import MeshSpec
from plait.models import MLP, FeedForward, GPTConfig, TinyGPT, gpt_loss, mlp_loss
from plait.planning import plan_graph
from plait.planning.outer import mesh_candidates
from plait.rules.registry import OpStrategy
from plait.search.constraints import with_orders
from tests.sim.test_equivalence import heads_over
from tests.sim.test_plan_exec import check_case, gpt_batches, sgd

XY = Layout((2, 2), ("x", "y"))
"""MindSpore's device matrix for 2-D tensor parallel: 4 devices as x=2 by y=2."""


def _feed_forward_2d(model: FeedForward) -> FeedForward:
    """MindSpore's 2-D layouts on every block. torch's ``Linear`` holds a weight ``[h, e]`` of
    MindSpore's as ``[e, h]``: MindSpore's ``layout("x", "y")`` is plait's ``("y", "x")``."""
    for up, down in zip(model.ups, model.downs, strict=True):
        plait.shard(
            up,
            parameter_strategy={"weight": XY("y", "x")},
            out_strategy=(XY("None", ("y", "x")),),
        )
        plait.shard(
            down,
            parameter_strategy={"weight": XY("x", "y")},
            out_strategy=(XY("None", ("x", "y")),),
        )
    return model


def _kinds(plan) -> Counter[tuple[str, str, str]]:
    """The plan's collectives a step by (kind, axis, phase)."""
    out: Counter[tuple[str, str, str]] = Counter()
    for c in plan.collectives:
        for axis in c.axes:
            out[(c.kind, axis, c.phase)] += c.count
    return out


def test_2d_tensor_parallel_gathers_in_one_axis_and_reduce_scatters_in_the_other():
    torch.manual_seed(0)
    model = _feed_forward_2d(FeedForward())
    batches = [(torch.randn(8, 16), torch.randn(8, 16)) for _ in range(4)]
    cfg = ParallelConfig(mode="semi_auto", mesh={"x": 2, "y": 2})
    plan = check_case(model, batches, cfg, mlp_loss, sgd, 4)
    # every matmul reads its activation gathered in one axis and reduce-scatters its partial
    # sums in the other, so the activations between them are held split over both axes
    # (a quarter each): no all-reduce anywhere
    assert not any(c.kind == "all_reduce" for c in plan.collectives), plan.summary()
    ops = {op.name: op for op in plan.ops}
    hidden = ops["relu"].inputs[0]
    assert hidden.dims == ((), ("y", "x")), hidden.describe()  # y first: against mesh order
    assert ops["add"].inputs[1].dims == ((), ("x", "y"))
    (note,) = [n for n in plan.notes if n.startswith("high-dimensional tensor parallel")]
    assert "4 parameter(s) split on two dims" in note and "ups.0.weight [y, x]" in note
    kinds = _kinds(plan)
    # forward: per block, up reduce-scatters in x and down in y; the next matmul of each
    # gathers its input back (the other axis); the loss gathers the last output whole
    assert kinds[("reduce_scatter", "x", "forward")] == 2
    assert kinds[("reduce_scatter", "y", "forward")] == 2


def test_3d_weight_split_over_three_axes_matches_one_device():
    """MindSpore's 3-D layouts (x, y, z): the weight's input dim over (x, z), its output dim
    over y; the activations leave split over all three."""
    torch.manual_seed(0)
    model = FeedForward(hidden=16, inner=16, blocks=1)
    xyz = Layout((2, 2, 2), ("x", "y", "z"))
    plait.shard(
        model.ups[0],
        parameter_strategy={"weight": xyz("y", ("x", "z"))},
        out_strategy=(xyz("None", ("y", "x", "z")),),
    )
    plait.shard(
        model.downs[0],
        parameter_strategy={"weight": xyz(("x", "z"), "y")},
        out_strategy=(xyz("None", ("x", "z", "y")),),
    )
    batches = [(torch.randn(8, 16), torch.randn(8, 16)) for _ in range(3)]
    cfg = ParallelConfig(mode="semi_auto", mesh={"x": 2, "y": 2, "z": 2})
    plan = check_case(model, batches, cfg, mlp_loss, sgd, 8)
    ops = {op.name: op for op in plan.ops}
    assert ops["relu"].inputs[0].dims == ((), ("y", "x", "z"))


def test_mlp_weights_split_over_two_axes_against_mesh_order_match_one_device():
    """``layout(("mp", "sp"), "None")`` on a mesh ``(dp, sp, mp)``: mp outermost."""
    torch.manual_seed(0)
    model = MLP((16, 32, 16, 8))
    batches = [(torch.randn(8, 16), torch.randn(8, 8)) for _ in range(3)]
    layout = Layout((2, 2, 2), ("dp", "sp", "mp"))
    plait.shard(model.layers[0], parameter_strategy={"weight": layout(("mp", "sp"), "None")})
    plait.shard(model.layers[1], parameter_strategy={"weight": layout("None", ("mp", "sp"))})
    cfg = ParallelConfig(mode="semi_auto", mesh={"dp": 2, "sp": 2, "mp": 2})
    # mlp_loss is F.mse_loss: its terms run on the local pieces (DTensor's strategy for
    # mse_loss_backward added two all-gathers on this mesh that the plan does not list)
    plan = check_case(model, batches, cfg, mlp_loss, sgd, 8)
    weights = {p.name: p.layout for p in plan.parameters}
    assert weights["layers.0.weight"].dims == (("mp", "sp"), ())
    # the hidden activation between the two stays split (mp, sp): nothing regathers it
    ops = {op.name: op for op in plan.ops}
    assert ops["gelu"].inputs[0].dims == (("dp",), ("mp", "sp"))
    assert not any("gelu needs" in c.reason for c in plan.collectives)


def test_gpt_heads_split_over_two_axes_against_mesh_order_match_one_device():
    torch.manual_seed(0)
    cfg_model = GPTConfig(vocab=32, seq=8, width=16, heads=4, layers=1)
    model = heads_over(TinyGPT(cfg_model), ("mp", "sp"))
    cfg = ParallelConfig(mode="semi_auto", mesh={"dp": 2, "sp": 2, "mp": 2})
    check_case(model, gpt_batches(cfg_model, 3), cfg, gpt_loss, sgd, 8)


def test_reordered_candidates_keep_their_letters_together():
    """A variant reorders the axes on every dim that shares them, input and output alike,
    and adds nothing where no dim is split over exactly those axes."""
    mesh = MeshSpec(("dp", "sp", "mp"), (2, 2, 2))
    both = TensorLayout(mesh, ((), ("sp", "mp")))
    s = OpStrategy((both, TensorLayout(mesh, (("sp", "mp"), ()))), (both,), "column")
    other = OpStrategy((TensorLayout(mesh, (("dp",), ())),), (TensorLayout(mesh, (("dp",), ())),))
    found = with_orders({"a": [s], "b": [other]}, {("mp", "sp")})
    assert len(found["a"]) == 2
    variant = found["a"][1]
    assert variant.inputs[0].dims == ((), ("mp", "sp"))
    assert variant.inputs[1].dims == (("mp", "sp"), ())
    assert variant.outputs[0] is variant.inputs[0]  # equal layouts: one object
    assert found["b"] == [other]


def test_an_order_no_strategy_can_read_is_refused_by_name():
    """A weight annotated over two axes whose input dim no matmul strategy splits that way
    stays refused with the strategies the op has."""
    model = MLP((16, 32, 8))
    layout = Layout((2, 2), ("x", "y"))
    plait.shard(model.layers[0], in_strategy=(layout("None", ("x", "y")),),
                parameter_strategy={"weight": layout("y", "x")})  # fmt: skip
    batches = [(torch.randn(8, 16), torch.randn(8, 8))]
    cfg = ParallelConfig(mode="semi_auto", mesh={"x": 2, "y": 2})
    with pytest.raises(ShardingError, match=r"no strategy satisfies input 0 of layers.0"):
        check_case(model, batches, cfg, mlp_loss, sgd, 4)


def test_auto_on_two_model_axes_chooses_2d_for_wide_layers():
    """Mode auto given a mesh with two model axes weighs the 2-D strategies: on wide layers
    and a large batch (h100 profile, 16 devices as 4 x 4) the second matmul's weight is
    split on both dims, one axis each, and the plan predicts the step faster than the 1-D
    split over the same 16 devices."""
    hidden = 4096
    with torch.device("meta"):
        model = FeedForward(hidden=hidden, inner=4 * hidden, blocks=1)
        batch = (torch.randn(4096, hidden), torch.randn(4096, hidden))
    captured = capture_program(model, batch, mlp_loss)
    plans = {
        name: plan_graph(
            captured.graph,
            ParallelConfig(mode="auto", mesh=mesh, search="dynamic_programming", hardware="h100"),
            model=model,
        )
        for name, mesh in (("2d", {"x": 4, "y": 4}), ("1d", {"tp": 16}))
    }
    weights = {p.name: p.layout.dims for p in plans["2d"].parameters}
    assert weights["downs.0.weight"] == (("y",), ("x",)), weights
    assert plans["2d"].predicted.step_time_s < plans["1d"].predicted.step_time_s


def test_free_mesh_search_weighs_two_model_axes_across_nodes():
    """Mode auto without a mesh weighs ``dp x tpx x tp`` (model parallel over more than a
    node, tp inside it, tpx across nodes) beside ``pp x dp x tp``: on wide layers and few
    rows over 16 H100s it is the fastest, and the note says what the two axes are."""
    hidden = 8192
    with torch.device("meta"):
        model = FeedForward(hidden=hidden, inner=4 * hidden, blocks=2)
        batch = (torch.randn(1024, hidden), torch.randn(1024, hidden))
    captured = capture_program(model, batch, mlp_loss)
    cfg = ParallelConfig(mode="auto", devices=16, hardware="h100", search="dynamic_programming")
    meshes = mesh_candidates(16, cfg, captured.graph, devices_per_node=8)
    assert {"dp": 1, "tpx": 2, "tp": 8} in meshes
    assert not any("tpx" in m for m in mesh_candidates(8, cfg, captured.graph, 8))
    plan = plan_graph(captured.graph, cfg, model=model)
    assert plan.mesh.as_dict() == {"dp": 1, "tpx": 2, "tp": 8}
    assert "model parallel over two axes: tpx across nodes, tp inside one" in plan.notes[-1]
