"""Layouts and strategies: MindSpore's notation, checked against hand-worked examples."""

import pytest

from plait.errors import LayoutError, ShardingError
from plait.layout import (
    Layout,
    OpSignature,
    Partial,
    Replicate,
    Shard,
    TensorLayout,
    resolve_strategy,
    resolve_tensor_strategy,
)
from plait.mesh import MeshSpec

DP_TP = MeshSpec.from_dict({"dp": 2, "tp": 2})
LINEAR = OpSignature("linear", (("b", "k"), ("n", "k")), ("b", "n"), ("input", "weight"))


def test_mesh_coordinates_are_row_major():
    mesh = MeshSpec.from_dict({"dp": 2, "tp": 4})
    assert [mesh.coordinate(r) for r in (0, 3, 4, 7)] == [(0, 0), (0, 3), (1, 0), (1, 3)]


def test_layout_tensor_map_counts_axes_from_the_right():
    layout = Layout((2, 2, 2), ("dp", "sp", "mp"))
    assert layout("dp", "mp").tensor_map() == (2, 0)
    assert layout("mp", ("sp", "dp")).tensor_map() == (0, (1, 2))
    assert layout("None", "sp").tensor_map() == (-1, 1)


def test_layout_placements_follow_mesh_order():
    t = Layout((2, 2, 2), ("dp", "sp", "mp"))("mp", ("sp", "dp"))
    assert t.placements() == (Shard(1), Shard(1), Shard(0))
    assert str(t.placements()[0]) == "S(1)" and repr(Replicate()) == "Replicate()"
    assert not t.is_mesh_ordered()


def test_layout_shard_index_matches_mindspore_worked_example():
    """("sp", "dp") on dim 1: sp picks the outer block, dp the piece inside it (2 * sp + dp)."""
    t = Layout((2, 2, 2), ("dp", "sp", "mp"))("mp", ("sp", "dp"))
    mesh = t.mesh
    for rank in range(8):
        dp, sp, mp = mesh.coordinate(rank)
        assert t.shard_index(rank, 0) == mp
        assert t.shard_index(rank, 1) == 2 * sp + dp


def test_layout_round_trips_through_placements_with_partial():
    t = TensorLayout(DP_TP, ((), ("dp",)), ("tp",))
    assert t.placements() == (Shard(1), Partial("sum"))
    assert TensorLayout.from_placements(DP_TP, t.placements(), 2) == t


def test_layout_alias_not_in_layout_is_refused():
    with pytest.raises(LayoutError, match=r"'mp' is not in the mesh .*use one of \['dp', 'tp'\]"):
        Layout((2, 2), ("dp", "tp"))("dp", "mp")


def test_layout_axis_used_twice_is_refused():
    with pytest.raises(LayoutError, match="used by tensor dims 0 and 1"):
        Layout((2, 2), ("dp", "tp"))("dp", ("tp", "dp"))


def test_layout_bad_device_matrix_is_refused():
    with pytest.raises(LayoutError, match="repeat a name"):
        Layout((2, 2), ("dp", "dp"))
    with pytest.raises(LayoutError, match="'None' is not allowed"):
        Layout((2,), ("None",))


def test_layout_uneven_dim_is_refused():
    t = Layout((2, 2), ("dp", "tp"))("tp", "None")
    with pytest.raises(LayoutError, match="dim 0 has size 5, which does not divide into 2 pieces"):
        t.check_shape((5, 4), "fc.weight")


def test_strategy_matmul_megatron_column_and_row():
    col = resolve_strategy(LINEAR, ((2, 1), (2, 1)), DP_TP, "fc1")
    assert [t.describe() for t in col.inputs] == ["[dp, None]", "[tp, None]"]
    assert col.output.describe() == "[dp, tp]"
    row = resolve_strategy(LINEAR, ((2, 2), (1, 2)), DP_TP, "fc2")
    assert row.output.describe() == "[dp, None] P(sum)@tp"


def test_strategy_repeated_calculation_takes_inner_axes():
    """MindSpore: a strategy using fewer devices leaves the outer axes repeating the op."""
    assert resolve_tensor_strategy((2, 1), DP_TP, "w").describe() == "[tp, None]"
    assert resolve_tensor_strategy((4, 1), DP_TP, "w").describe() == "[(dp, tp), None]"


def test_strategy_length_must_match_tensor_rank():
    with pytest.raises(ShardingError, match=r"has 3 entries but the tensor has 2 dims"):
        resolve_tensor_strategy((2, 1, 1), DP_TP, "fc.weight", (8, 8))


def test_strategy_product_must_divide_devices():
    with pytest.raises(ShardingError, match="multiply to 8, which exceeds the 4 devices"):
        resolve_tensor_strategy((4, 2), DP_TP, "w")
    with pytest.raises(ShardingError, match="multiply to 3, which does not divide the 4 devices"):
        resolve_tensor_strategy((3, 1), DP_TP, "w")


def test_strategy_inconsistent_shared_dim_is_refused():
    with pytest.raises(ShardingError, match="split 2 and 1; make the two splits equal"):
        resolve_strategy(LINEAR, ((1, 2), (1, 1)), DP_TP, "fc")


def test_strategy_split_not_matching_mesh_axes_is_refused():
    mesh = MeshSpec.from_dict({"dp": 2, "tp": 4})
    with pytest.raises(ShardingError, match="does not match the mesh"):
        resolve_tensor_strategy((2, 1), mesh, "w")
