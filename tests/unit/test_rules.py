"""The op catalogue: strategies, local shapes, partial sums, gradient axes, memory, coverage."""

from __future__ import annotations

import pytest
import torch

from plait.errors import ShardingError
from plait.graph import OpNode, Ref, TensorMeta
from plait.layout import resolve_strategy
from plait.mesh import MeshSpec
from plait.rules import (
    Catalogue,
    OpMemory,
    default_catalogue,
    grad_reduce_axes,
    op_memory,
    strategy_from_cuts,
)
from plait.rules.signatures import linear_signature
from plait.rules.view import view_groups

SQUARE = MeshSpec(("dp", "tp"), (2, 2))
CUBE = MeshSpec(("a", "b", "c"), (2, 2, 2))
LINE = MeshSpec(("tp",), (4,))


def mk(target, ins, outs, *args, params=(), dtypes=None, **kwargs) -> OpNode:
    """An OpNode from shapes; ``args`` name tensors by ``Ref``."""
    dtypes = dtypes or {}
    return OpNode(
        target.split(".")[1],
        target,
        tuple(f"in{i}" for i in range(len(ins))),
        tuple(TensorMeta(tuple(s), dtypes.get(i, "float32")) for i, s in enumerate(ins)),
        tuple(TensorMeta(tuple(s)) for s in outs),
        args,
        tuple(kwargs.items()),
        params=tuple(params),
    )


def strategies(op, mesh=SQUARE):
    return default_catalogue().strategies(op, mesh)


def by_layouts(op, mesh, *dims):
    """The strategy whose input layouts describe as ``dims``."""
    for s in strategies(op, mesh):
        if tuple(lay.describe() for lay in s.inputs) == dims:
            return s
    raise AssertionError(f"no strategy with inputs {dims}")


LINEAR = mk(
    "aten.linear.default",
    [(8, 16, 32), (64, 32), (64,)],
    [(8, 16, 64)],
    Ref(0),
    Ref(1),
    Ref(2),
    params=("fc.weight", "fc.bias"),
)


def test_linear_offers_replicate_first_and_every_split():
    found = strategies(LINEAR)
    assert found[0].label == "replicate"
    assert all(lay.partial == () for s in found for lay in s.inputs)
    labels = {s.label for s in found}
    assert {"batch", "column", "row", "batch+column", "batch+row", "row+column"} <= labels
    # 4 letters (batch, seq, row, column), 2 axes of size 2: 5 * 5 choices, all divide.
    assert len(found) == 25
    assert found == strategies(LINEAR)  # deterministic


def test_linear_row_split_leaves_a_pending_sum_and_column_splits_the_output():
    row = by_layouts(LINEAR, SQUARE, "[dp, None, tp]", "[None, tp]", "[None]")
    out = row.outputs[0]
    assert out.partial == ("tp",) and out.reduce_op == "sum"
    assert out.local_shape((8, 16, 64)) == (4, 16, 64)
    assert row.inputs[0].local_shape((8, 16, 32)) == (4, 16, 16)
    column = by_layouts(LINEAR, SQUARE, "[dp, None, None]", "[tp, None]", "[tp]")
    assert column.outputs[0].partial == ()
    assert column.outputs[0].local_shape((8, 16, 64)) == (4, 16, 32)
    assert column.inputs[1].local_shape((64, 32)) == (32, 32)


def test_grad_reduce_axes_for_linear_weight_under_batch_column_and_row():
    batch = by_layouts(LINEAR, SQUARE, "[dp, None, None]", "[None, None]", "[None]")
    assert grad_reduce_axes(batch, 1) == ("dp",)
    column = by_layouts(LINEAR, SQUARE, "[None, None, None]", "[tp, None]", "[tp]")
    assert grad_reduce_axes(column, 1) == ()
    both = by_layouts(LINEAR, SQUARE, "[dp, None, tp]", "[None, tp]", "[None]")
    assert grad_reduce_axes(both, 1) == ("dp",)
    # the bias is added after the sum over tp: its gradient is whole on tp
    assert grad_reduce_axes(both, 2) == ("dp",)


def test_matmul_broadcast_weight_has_no_batch_split():
    op = mk("aten.matmul.default", [(8, 4, 16), (16, 6)], [(8, 4, 6)], Ref(0), Ref(1))
    for s in strategies(op):
        assert s.inputs[1].dims[0] == s.inputs[0].dims[2]  # k split alike
        if s.inputs[0].dims[2]:
            assert s.outputs[0].partial == s.inputs[0].dims[2]
    # n = 6 takes one axis at most; b0 = 8, m = 4, k = 16 take any
    cube = strategies(op, CUBE)
    assert all(len(s.inputs[1].dims[1]) <= 1 for s in cube)
    assert any(len(s.inputs[0].dims[0]) == 3 for s in cube)


def test_matmul_splits_heads_of_attention_scores():
    op = mk("aten.matmul.default", [(2, 4, 8, 16), (2, 4, 16, 8)], [(2, 4, 8, 8)], Ref(0), Ref(1))
    s = by_layouts(op, SQUARE, "[dp, tp, None, None]", "[dp, tp, None, None]")
    assert s.label == "batch+b1" and s.outputs[0].dims == (("dp",), ("tp",), (), ())


def test_pointwise_broadcast_keeps_the_smaller_input_unsplit_on_new_dims():
    op = mk("aten.add.Tensor", [(8, 16, 32), (16, 1)], [(8, 16, 32)], Ref(0), Ref(1))
    found = strategies(op)
    for s in found:
        x, y = s.inputs
        assert y.dims[0] == x.dims[1] and y.dims[1] == ()
    assert len(found) == 16  # 3 dims, 2 axes: 4 * 4


def test_softmax_never_splits_its_dim():
    op = mk("aten.softmax.int", [(4, 8, 16)], [(4, 8, 16)], Ref(0), -1)
    assert all(s.inputs[0].dims[2] == () for s in strategies(op, CUBE))
    assert len(strategies(op)) == 9


def _sdpa(h, hk, causal, gqa=False):
    return mk(
        "aten.scaled_dot_product_attention.default",
        [(4, h, 16, 8), (4, hk, 16, 8), (4, hk, 16, 8)],
        [(4, h, 16, 8)],
        Ref(0),
        Ref(1),
        Ref(2),
        is_causal=causal,
        enable_gqa=gqa,
    )


def test_sdpa_splits_batch_and_heads_and_queries_only_without_causal_mask():
    causal = {s.label for s in strategies(_sdpa(4, 4, True))}
    assert causal == {"replicate", "batch", "heads", "batch+heads"}
    free = {s.label for s in strategies(_sdpa(4, 4, False))}
    assert {"query", "heads+query"} <= free


def test_sdpa_gqa_splits_heads_only_when_kv_heads_divide():
    op = _sdpa(8, 2, True, gqa=True)
    heads = [s for s in strategies(op, LINE) if "heads" in s.label]
    assert heads == []  # 4 does not divide 2 kv heads
    s = by_layouts(op, SQUARE, *["[None, tp, None, None]"] * 3)
    assert s.outputs[0].local_shape((4, 8, 16, 8)) == (4, 4, 16, 8)
    assert s.inputs[1].local_shape((4, 2, 16, 8)) == (4, 1, 16, 8)
    assert not strategies(_sdpa(8, 2, True, gqa=False))[1:]  # mismatched heads without GQA


def test_view_groups_match_merges_and_splits():
    assert view_groups((2, 3, 4), (6, 4)) == [((0, 1), (0,)), ((2,), (1,))]
    assert view_groups((8, 6), (6, 8)) == [((0, 1), (0, 1))]
    assert view_groups((4, 1, 8), (4, 8)) == [((0,), (0,)), ((2,), (1,))]
    assert view_groups((4, 8), (5, 6)) is None


def test_reshape_splits_the_first_dim_of_each_group():
    split = mk("aten.view.default", [(8, 16, 32)], [(8, 16, 4, 8)], Ref(0), [8, 16, 4, 8])
    outs = {s.outputs[0].describe() for s in strategies(split)}
    assert "[None, None, tp, None]" in outs and "[None, None, None, tp]" not in outs
    merge = mk("aten.reshape.default", [(8, 16, 4, 8)], [(8, 16, 32)], Ref(0), [8, 16, 32])
    ins = {s.inputs[0].describe() for s in strategies(merge)}
    assert "[None, None, tp, None]" in ins and "[None, None, None, tp]" not in ins
    mixed = mk("aten.view.default", [(6, 4)], [(4, 6)], Ref(0), [4, 6])
    assert {s.inputs[0].describe() for s in strategies(mixed, LINE)} == {"[None, None]"}
    assert len(strategies(mixed)) == 3  # gcd(6, 4) = 2: one axis at a time


def test_transpose_moves_the_split():
    op = mk("aten.transpose.int", [(2, 4, 8)], [(2, 8, 4)], Ref(0), 1, 2)
    s = by_layouts(op, SQUARE, "[None, dp, tp]")
    assert s.outputs[0].describe() == "[None, tp, dp]"


@pytest.mark.parametrize(
    ("target", "kind"),
    [
        ("aten.sum.dim_IntList", "sum"),
        ("aten.mean.dim", "avg"),
        ("aten.amax.default", "max"),
        ("aten.amin.default", "min"),
    ],
)
def test_reductions_over_a_split_dim_leave_an_exact_pending_reduction(target, kind):
    op = mk(target, [(4, 8)], [(4, 1)], Ref(0), [-1], True)
    s = by_layouts(op, SQUARE, "[dp, tp]")
    assert s.outputs[0].describe() == f"[dp, None] P({kind})@tp"


def test_index_returning_and_nonlinear_reductions_keep_the_dim_whole():
    for target in ("aten.max.dim", "aten.var.correction", "aten.logsumexp.default"):
        outs = [(4,), (4,)] if target == "aten.max.dim" else [(4,)]
        op = mk(target, [(4, 8)], outs, Ref(0), [1] if "max" not in target else 1)
        assert all(s.inputs[0].dims[1] == () for s in strategies(op)), target


def test_cross_entropy_reductions():
    def ce(reduction, weight=False):
        ins = [(8, 10), (8,)] + ([(10,)] if weight else [])
        args = (Ref(0), Ref(1), Ref(2) if weight else None, reduction)
        return mk(
            "aten.cross_entropy_loss.default",
            ins,
            [(8,)] if reduction == 0 else [()],
            *args,
            dtypes={1: "int64"},
        )

    mean = by_layouts(ce(1), SQUARE, "[dp, None]", "[dp]")
    assert mean.outputs[0].describe() == "[] P(avg)@dp"
    assert by_layouts(ce(2), SQUARE, "[dp, None]", "[dp]").outputs[0].reduce_op == "sum"
    assert by_layouts(ce(0), SQUARE, "[dp, None]", "[dp]").outputs[0].describe() == "[dp]"
    assert len(strategies(ce(1, weight=True))) == 1  # a weighted mean is not split
    assert all(s.inputs[0].dims[1] == () for s in strategies(ce(1)))  # classes stay whole


def test_conv_in_channel_split_is_partial_and_groups_split_batch_only():
    conv = mk(
        "aten.conv2d.default",
        [(4, 8, 6, 6), (16, 8, 3, 3), (16,)],
        [(4, 16, 6, 6)],
        Ref(0),
        Ref(1),
        Ref(2),
        [1, 1],
        [1, 1],
    )
    s = by_layouts(conv, SQUARE, "[dp, tp, None, None]", "[None, tp, None, None]", "[None]")
    assert s.outputs[0].describe() == "[dp, None, None, None] P(sum)@tp"
    assert {s.label for s in strategies(conv)} >= {"batch", "out_channels", "in_channels"}
    grouped = mk(
        "aten.conv2d.default",
        [(4, 8, 6, 6), (8, 4, 3, 3)],
        [(4, 8, 6, 6)],
        Ref(0),
        Ref(1),
        None,
        [1, 1],
        [1, 1],
        [1, 1],
        2,
    )
    assert {s.label for s in strategies(grouped)} == {"replicate", "batch"}


def test_batch_norm_in_training_splits_channels_only():
    def bn(training):
        return mk(
            "aten.batch_norm.default",
            [(4, 8, 2, 2), (8,), (8,), (8,), (8,)],
            [(4, 8, 2, 2)],
            Ref(0),
            Ref(1),
            Ref(2),
            Ref(3),
            Ref(4),
            training,
            0.1,
            1e-5,
            False,
        )

    assert {s.label for s in strategies(bn(True))} == {"replicate", "channel"}
    assert "batch" in {s.label for s in strategies(bn(False))}


def test_layer_norm_keeps_normalised_dims_and_weights_whole():
    op = mk(
        "aten.layer_norm.default",
        [(4, 8, 16), (16,), (16,)],
        [(4, 8, 16)],
        Ref(0),
        [16],
        Ref(1),
        Ref(2),
        1e-5,
        False,
    )
    for s in strategies(op, CUBE):
        assert s.inputs[0].dims[2] == () and s.inputs[1].dims == ((),)


def test_embedding_vocab_split_is_a_pending_sum():
    op = mk(
        "aten.embedding.default",
        [(64, 32), (4, 8)],
        [(4, 8, 32)],
        Ref(0),
        Ref(1),
        dtypes={1: "int64"},
    )
    s = by_layouts(op, SQUARE, "[tp, None]", "[dp, None]")
    assert s.outputs[0].describe() == "[dp, None, None] P(sum)@tp"
    assert s.label == "vocab+batch"


def test_op_memory_counts_local_parameters_saved_inputs_and_outputs():
    column = by_layouts(LINEAR, SQUARE, "[dp, None, None]", "[tp, None]", "[tp]")
    mem = op_memory(LINEAR, column)
    assert mem == OpMemory(
        parameters=(64 * 32 // 2 + 64 // 2) * 4,
        saved=8 * 16 * 32 // 2 * 4,
        output=8 * 16 * 64 // 4 * 4,
    )
    assert mem.total == mem.parameters + mem.saved + mem.output
    # without parameters named by the op, every input is an activation
    plain = OpNode(**{**{f: getattr(LINEAR, f) for f in LINEAR.__slots__}, "params": ()})
    assert op_memory(plain, column).parameters == 0


def test_sdpa_memory_saves_logsumexp_not_the_score_matrix():
    op = _sdpa(4, 4, True)
    mem = op_memory(op, strategies(op)[0])
    qkvo = 4 * (4 * 4 * 16 * 8) * 4
    assert mem.saved == qkvo + 4 * 4 * 16 * 4  # + float32 logsumexp per query row
    assert mem.saved < qkvo + 4 * 4 * 16 * 16 * 4  # the 16 x 16 scores are not kept


def test_strategy_from_cuts_follows_mindspore_right_laid_axes():
    op = mk("aten.linear.default", [(8, 32), (64, 32)], [(8, 64)], Ref(0), Ref(1))
    cuts = ((2, 1), (2, 1))  # column parallel with data parallel
    s = strategy_from_cuts(op, cuts, SQUARE)
    resolved = resolve_strategy(linear_signature(2), cuts, SQUARE, "test")
    assert s.inputs == resolved.inputs and s.cuts() == cuts
    with pytest.raises(
        ShardingError, match=r"linear.*\(\(4, 1\), \(1, 1\)\).*valid strategy tuples"
    ):
        strategy_from_cuts(op, ((4, 1), (1, 1)), MeshSpec(("dp",), (2,)))


def test_catalogue_is_built_once_and_falls_back_to_replicated():
    cat = default_catalogue()
    assert cat is default_catalogue()
    odd = mk("aten.fft_fft.default", [(4, 8)], [(4, 8)], Ref(0))
    assert not cat.covers(odd) and cat.rule_for(odd.target) is None
    assert [s.label for s in cat.strategies(odd, SQUARE)] == ["replicate"]
    assert cat.missing([odd, LINEAR]) == ("aten.fft_fft.default",)
    assert set(cat.families()) == {
        "matmul",
        "pointwise",
        "norm",
        "softmax",
        "embedding",
        "attention",
        "view",
        "reduction",
        "conv",
        "pooling",
        "loss",
        "creation",
    }
    rule = cat.rule_for("aten.linear.default")
    with pytest.raises(ShardingError, match="two rules"):
        Catalogue((rule, rule))


# --- coverage of the zoo models -------------------------------------------------------------

ZOO = {"gpt": {}, "llama": {"heads": 4, "kv_heads": 2}, "bert": {}, "mlp": {}, "cnn": {}}


@pytest.fixture(scope="module")
def zoo_graphs():
    from plait.graph import capture
    from plait.models import ModelSpec, build

    graphs = {}
    for kind, kw in ZOO.items():
        with torch.device("meta"):
            model, batch, loss = build(ModelSpec(kind=kind, layers=2, **kw))
        graphs[kind] = capture(model, batch, loss)
    return graphs


@pytest.mark.parametrize("kind", sorted(ZOO))
def test_every_zoo_op_has_a_rule_and_few_strategies(kind, zoo_graphs):
    cat = default_catalogue()
    graph = zoo_graphs[kind]
    assert cat.missing(graph.ops) == ()
    for op in graph.ops:
        found = cat.strategies(op, CUBE)
        assert found[0].label == "replicate"
        assert len(found) < 300, (op.name, len(found))
        for s in found:
            assert len(s.inputs) == len(op.inputs) and len(s.outputs) == len(op.outputs)
            for meta, lay in zip(
                (*op.input_metas, *op.outputs), (*s.inputs, *s.outputs), strict=True
            ):
                lay.check_shape(meta.shape)
        if op.target == "aten.linear.default":
            assert {"column", "row"} <= {s.label for s in cat.strategies(op, SQUARE)}
