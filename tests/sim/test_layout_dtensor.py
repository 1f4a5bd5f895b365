"""Exact conversion between plait layouts and DTensor placements.

Reference: a plait layout's own slicing rule (``TensorLayout.shard_index``, MindSpore's
device-matrix semantics) against the local pieces DTensor actually gives each simulated rank.
"""

import itertools

import pytest
import torch
from torch.distributed.tensor import DTensor

import plait
from plait import Layout, TensorLayout
from plait._compat import StridedShard
from plait.comm.dtensor import (
    build_device_mesh,
    distribute,
    from_dtensor_placements,
    layout_of,
    to_dtensor_placements,
    to_layout,
)

LAYOUT = Layout((2, 2, 2), ("dp", "sp", "mp"))
AXES = ("dp", "sp", "mp")


def _dim_specs():
    yield "None"
    for n in (1, 2, 3):
        for combo in itertools.permutations(AXES, n):
            yield combo[0] if n == 1 else combo


def _layouts():
    for d0, d1 in itertools.product(_dim_specs(), repeat=2):
        used = [a for d in (d0, d1) if d != "None" for a in ((d,) if isinstance(d, str) else d)]
        if len(used) == len(set(used)):
            yield LAYOUT(d0, d1)


def _expected_piece(full, layout, rank):
    index = []
    for dim, (size, pieces) in enumerate(zip(full.shape, layout.splits(), strict=True)):
        i = layout.shard_index(rank, dim)
        index.append(slice(i * size // pieces, (i + 1) * size // pieces))
    return full[tuple(index)]


def test_every_two_dim_layout_on_a_3d_mesh_converts_exactly():
    full = torch.arange(16 * 8, dtype=torch.float32).reshape(16, 8)
    layouts = list(_layouts())
    assert (
        len(layouts) == 49
    )  # every disjoint assignment of the three axes to two dims, in every order
    with plait.testing.simulate(8):
        mesh = build_device_mesh(LAYOUT.mesh)
        for layout in layouts:
            dt = distribute(full, mesh, layout)
            assert layout_of(dt) == layout, layout.describe()
            pieces = dt.to_local()._local_tensors
            for rank in range(8):
                assert torch.equal(pieces[rank], _expected_piece(full, layout, rank)), (
                    layout.describe(),
                    rank,
                )
            assert torch.equal(plait.comm.dtensor.full_value(dt), full)


def test_strided_shard_for_order_against_mesh():
    t = LAYOUT("None", ("mp", "dp"))
    placements = to_dtensor_placements(t)
    assert isinstance(placements[0], StridedShard) and placements[0].split_factor == 2
    assert from_dtensor_placements(LAYOUT.mesh, placements, 2) == t


def test_partial_round_trip_and_reduction():
    mesh_spec = Layout((2, 2), ("dp", "tp")).mesh
    partial = TensorLayout(mesh_spec, (("dp",), ()), ("tp",))
    assert [str(p) for p in to_dtensor_placements(partial)] == ["S(0)", "P(sum)"]
    assert from_dtensor_placements(mesh_spec, to_dtensor_placements(partial), 2) == partial
    with plait.testing.simulate(4):
        mesh = build_device_mesh(mesh_spec)
        # every rank contributes ones; the pending sum over tp (2 ranks) is 2
        pending = DTensor.from_local(
            torch.ones(2, 3), mesh, to_dtensor_placements(partial), run_check=False
        )
        assert layout_of(pending) == partial
        reduced = to_layout(pending, TensorLayout(mesh_spec, (("dp",), ())))
        assert torch.equal(plait.comm.dtensor.full_value(reduced), torch.full((4, 3), 2.0))


def test_uneven_dim_is_refused_before_slicing():
    with plait.testing.simulate(4):
        mesh = build_device_mesh(Layout((2, 2), ("dp", "tp")).mesh)
        with pytest.raises(plait.LayoutError, match="dim 0 has size 5"):
            distribute(torch.ones(5, 4), mesh, Layout((2, 2), ("dp", "tp"))("tp", "None"))
