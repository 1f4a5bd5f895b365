"""Dataset sharding (plait.data): sampler guarantees, resumption, per-input slicing, for_job.

Reference: the global batch itself. A rank's slices, concatenated in data-parallel order,
must give back the global batch in order; per-input slices are checked against hand-cut
tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import plait
from plait.data import InputSlicer, ShardedLoader, ShardedSampler, input_layouts, slice_batch
from plait.errors import ConfigError, LayoutError, PlaitError
from plait.mesh import MeshSpec


def _sampler(rank: int = 0, **kw: Any) -> ShardedSampler:
    dataset_len = kw.pop("dataset_len", 30)
    args: dict[str, Any] = dict(global_batch_size=8, dp_size=4, dp_rank=rank, seed=3)
    args.update(kw)
    return ShardedSampler(dataset_len, **args)


def _epoch_batches(sampler: ShardedSampler, epoch: int) -> list[list[int]]:
    return list(sampler.local_batches(epoch))


# Sampler guarantees ---------------------------------------------------------------------------


def test_sampler_slices_are_disjoint_and_cover_each_global_batch():
    ranks = [_sampler(r) for r in range(4)]
    for step in range(ranks[0].num_batches):
        slices = [s.local_batch(0, step) for s in ranks]
        flat = [i for piece in slices for i in piece]
        assert len(set(flat)) == len(flat) == 8
        assert set(flat) == set(ranks[0].global_batch(0, step))


def test_sampler_concatenation_in_dp_order_is_the_global_batch():
    ranks = [_sampler(r) for r in range(4)]
    per_rank = [_epoch_batches(s, 1) for s in ranks]
    for step in range(ranks[0].num_batches):
        joined = [i for r in range(4) for i in per_rank[r][step]]
        assert joined == ranks[0].global_batch(1, step)


def test_sampler_global_batches_do_not_depend_on_dp_size():
    one = ShardedSampler(30, global_batch_size=8, seed=3)
    four = _sampler(2)
    assert one.global_batch(2, 1) == four.global_batch(2, 1)
    assert _epoch_batches(one, 2)[1] == one.global_batch(2, 1)


def test_sampler_epoch_has_no_repeats_and_drops_the_remainder():
    s = ShardedSampler(30, global_batch_size=8, seed=3)
    seen = [i for step in range(s.num_batches) for i in s.global_batch(0, step)]
    assert s.num_batches == 3 and len(seen) == 24 and len(set(seen)) == 24
    assert len(_sampler(1)) == 3 * 2


def test_sampler_is_deterministic_across_constructions():
    assert _epoch_batches(_sampler(1), 0) == _epoch_batches(_sampler(1), 0)
    assert list(_sampler(1)) == [i for b in _epoch_batches(_sampler(1), 0) for i in b]


def test_sampler_epochs_differ_with_shuffle_and_seeds_differ():
    s = _sampler(0)
    assert s.permutation(0) != s.permutation(1)
    assert s.permutation(0) != _sampler(0, seed=4).permutation(0)
    assert sorted(s.permutation(7)) == list(range(30))


def test_sampler_without_shuffle_keeps_dataset_order():
    s = _sampler(1, shuffle=False)
    assert _epoch_batches(s, 0) == [[2, 3], [10, 11], [18, 19]]
    assert _epoch_batches(s, 5) == _epoch_batches(s, 0)


def test_sampler_keep_last_completes_the_last_batch_from_the_epoch_start():
    s = ShardedSampler(30, global_batch_size=8, shuffle=False, drop_last=False)
    assert s.num_batches == 4
    assert s.global_batch(0, 3) == [24, 25, 26, 27, 28, 29, 0, 1]
    tiny = ShardedSampler(3, global_batch_size=4, dp_size=2, dp_rank=1, drop_last=False)
    assert len(tiny.local_batch(0, 0)) == 2


def test_sampler_iteration_advances_the_position_and_the_epoch():
    s = _sampler(0)
    first = list(s)
    assert (s.epoch, s.step) == (1, 0)
    assert list(s) == [i for b in _epoch_batches(_sampler(0), 1) for i in b]
    assert first != list(s)


def test_sampler_resumes_mid_epoch_identically():
    full = _epoch_batches(_sampler(2), 4)
    s = _sampler(2)
    s.set_epoch(4)
    it = iter(s)
    for _ in range(2 * s.local_batch_size):  # two whole local batches
        next(it)
    state = s.state_dict()
    assert (state["epoch"], state["step"], state["seed"]) == (4, 2, 3)
    resumed = _sampler(2)
    resumed.load_state_dict(state)
    resumed.set_epoch(4)  # the same epoch keeps the restored position
    assert list(resumed) == [i for b in full[2:] for i in b]


def test_sampler_resumes_on_another_dp_size():
    s = _sampler(0)
    s.load_state_dict({**_sampler(3).state_dict(), "epoch": 1, "step": 1})
    two = _sampler(1, dp_size=2)
    two.load_state_dict(s.state_dict())
    assert list(two) == [i for b in _epoch_batches(_sampler(1, dp_size=2), 1)[1:] for i in b]


def test_sampler_set_epoch_to_another_epoch_restarts_it():
    s = _sampler(0)
    s.load_state_dict({**s.state_dict(), "epoch": 2, "step": 2})
    s.set_epoch(3)
    assert (s.epoch, s.step) == (3, 0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"global_batch_size": 6}, r"global_batch_size=6 does not divide into dp_size=4"),
        ({"dp_rank": 4}, r"dp_rank=4 is out of range for dp_size=4"),
        ({"dp_rank": -1}, r"dp_rank=-1 is not allowed"),
        ({"dataset_len": 5}, r"dataset_len=5 is smaller than global_batch_size=8"),
        ({"dp_size": 0}, r"dp_size=0 is not allowed; use an integer >= 1"),
        ({"global_batch_size": 0}, r"global_batch_size=0 is not allowed"),
        ({"seed": -2}, r"seed=-2 is not allowed"),
    ],
)
def test_sampler_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        _sampler(**kwargs)


def test_sampler_refuses_a_state_of_another_sequence():
    state = _sampler(0).state_dict()
    with pytest.raises(ConfigError, match=r"saved state has seed=3 .* build the sampler with"):
        _sampler(0, seed=9).load_state_dict(state)
    with pytest.raises(ConfigError, match=r"step=7: an epoch has only 3 global batches"):
        _sampler(0).load_state_dict({**state, "step": 7})


def test_sampler_is_a_torch_sampler_usable_by_dataloader():
    data = TensorDataset(torch.arange(30))
    s = _sampler(1)
    loader = torch.utils.data.DataLoader(data, sampler=s, batch_size=s.local_batch_size)
    got = [b[0].tolist() for b in loader]
    assert got == _epoch_batches(_sampler(1), 0)


# Loader ---------------------------------------------------------------------------------------


def _dataset(n: int = 20) -> TensorDataset:
    x = torch.arange(n * 3, dtype=torch.float32).reshape(n, 3)
    return TensorDataset(x, torch.arange(n))


def test_loader_ranks_concatenate_to_the_global_batch():
    data = _dataset()
    whole = list(ShardedLoader(data, global_batch_size=4, seed=1))
    parts = [
        list(ShardedLoader(data, global_batch_size=4, dp_size=2, dp_rank=r, seed=1)) for r in (0, 1)
    ]
    assert len(whole) == 5 == len(ShardedLoader(data, global_batch_size=4))
    for step, (x, y) in enumerate(whole):
        torch.testing.assert_close(torch.cat([parts[0][step][0], parts[1][step][0]]), x)
        torch.testing.assert_close(torch.cat([parts[0][step][1], parts[1][step][1]]), y)


def test_loader_resumes_from_its_state_dict():
    data = _dataset()
    full = [y.tolist() for _, y in ShardedLoader(data, global_batch_size=4, dp_size=2, dp_rank=1)]
    loader = ShardedLoader(data, global_batch_size=4, dp_size=2, dp_rank=1, num_workers=0)
    seen = []
    for _, y in loader:
        seen.append(y.tolist())
        if len(seen) == 3:
            break
    state = loader.state_dict()
    assert (state["epoch"], state["step"]) == (0, 3)
    again = ShardedLoader(data, global_batch_size=4, dp_size=2, dp_rank=1)
    again.load_state_dict(state)
    assert seen + [y.tolist() for _, y in again] == full
    assert (again.epoch, again.step) == (1, 0)


def test_loader_with_worker_processes_gives_the_same_batches():
    data = _dataset()
    plain = ShardedLoader(data, global_batch_size=4, dp_size=2, dp_rank=1)
    workers = ShardedLoader(data, global_batch_size=4, dp_size=2, dp_rank=1, num_workers=1)
    assert _labels(workers) == _labels(plain)


def test_loader_epochs_advance_and_differ():
    loader = ShardedLoader(_dataset(), global_batch_size=4, dp_size=2, dp_rank=0)
    first = [y.tolist() for _, y in loader]
    second = [y.tolist() for _, y in loader]
    assert first != second
    loader.set_epoch(0)
    assert [y.tolist() for _, y in loader] == first


def test_loader_refuses_dp_numbers_with_a_slicer():
    slicer = InputSlicer.build("data_parallel", [(4, 3)], MeshSpec.from_dict({"dp": 2}), 0)
    with pytest.raises(ConfigError, match="slicer decides which samples"):
        ShardedLoader(_dataset(), global_batch_size=4, dp_size=2, slicer=slicer)


# Per-input strategies -------------------------------------------------------------------------

MESH_2X2 = MeshSpec.from_dict({"dp": 2, "tp": 2})
MESH_2X2X2 = MeshSpec.from_dict({"dp": 2, "sp": 2, "mp": 2})


def _grid(*shape: int) -> torch.Tensor:
    return torch.arange(torch.Size(shape).numel()).reshape(shape)


def test_slice_batch_2x2_rows_on_dp_cols_on_tp():
    x, y = _grid(4, 6), torch.arange(4)
    expected = {
        0: (x[0:2, 0:3], y[0:2]),
        1: (x[0:2, 3:6], y[0:2]),
        2: (x[2:4, 0:3], y[2:4]),
        3: (x[2:4, 3:6], y[2:4]),
    }
    for rank, (ex, ey) in expected.items():
        gx, gy = slice_batch((x, y), ((2, 2), (2,)), MESH_2X2, rank)
        assert torch.equal(gx, ex) and torch.equal(gy, ey)


def test_slice_batch_2x2_last_dim_only_is_mindspore_from_the_right():
    x, y = _grid(2, 3, 4), torch.arange(2)
    # ((1, 1, 2), (1,)): the width is split on tp; the batch is not split, labels are whole.
    for rank in range(4):
        tp = MESH_2X2.coordinate(rank)[1]
        gx, gy = slice_batch((x, y), ((1, 1, 2), (1,)), MESH_2X2, rank)
        assert torch.equal(gx, x[:, :, 2 * tp : 2 * tp + 2]) and torch.equal(gy, y)


def test_slice_batch_2x2x2_hand_computed():
    x = _grid(4, 4, 6)
    # (2, 2, 2): dim 0 on dp, then dims 1, 2 on the free axes sp, mp from the right.
    for rank in range(8):
        dp, sp, mp = MESH_2X2X2.coordinate(rank)
        got = slice_batch(x, (2, 2, 2), MESH_2X2X2, rank)
        assert torch.equal(got, x[2 * dp : 2 * dp + 2, 2 * sp : 2 * sp + 2, 3 * mp : 3 * mp + 3])


def test_slice_batch_2x2x2_layout_with_two_axes_on_one_dim():
    layout = plait.Layout((2, 2, 2), ("dp", "sp", "mp"))
    x = _grid(4, 8)
    # dim 0 on mp; dim 1 on sp (outer) then dp (inner): piece 2 * sp + dp of 4.
    for rank in range(8):
        dp, sp, mp = MESH_2X2X2.coordinate(rank)
        (got,) = slice_batch((x,), (layout("mp", ("sp", "dp")),), MESH_2X2X2, rank)
        k = 2 * sp + dp
        assert torch.equal(got, x[2 * mp : 2 * mp + 2, 2 * k : 2 * k + 2])


def test_slice_batch_full_batch_and_data_parallel():
    x = _grid(4, 2)
    assert torch.equal(slice_batch(x, "full_batch", MESH_2X2, 3), x)
    assert torch.equal(slice_batch(x, "data_parallel", MESH_2X2, 3), x[2:4])
    assert torch.equal(slice_batch(x, "data_parallel", MESH_2X2, 1), x[0:2])


def test_slice_batch_refuses_a_rank_outside_the_mesh():
    with pytest.raises(LayoutError, match=r"rank=4 is not in mesh"):
        slice_batch(_grid(4, 2), "data_parallel", MESH_2X2, 4)


def test_input_layouts_give_dtensor_placements():
    lays = input_layouts(((2, 2), (1,)), [(4, 6), (4,)], MESH_2X2)
    assert [str(p) for p in lays[0].placements()] == ["S(0)", "S(1)"]
    assert [str(p) for p in lays[1].placements()] == ["R", "R"]
    assert lays[0].local_shape((4, 6)) == (2, 3)


@pytest.mark.parametrize(
    ("strategies", "shapes", "match"),
    [
        (((2, 2),), [(4, 5)], r"dim 1 has size 5, which does not divide into 2 pieces"),
        (((2,), (2,)), [(4, 6)], r"gives 2 strategies for a batch of 1 inputs"),
        (((2, 1, 1),), [(4, 6)], r"has 3 entries but the input has 2 dims"),
        (((8, 1),), [(8, 6)], r"multiply to 8, which exceeds the 4 devices"),
        (("dp",), [(4,)], r"neither a tuple of split counts nor a TensorLayout"),
        ("sharded", [(4,)], r"dataset_strategy='sharded' is not allowed"),
    ],
)
def test_input_layouts_errors(strategies, shapes, match):
    with pytest.raises(PlaitError, match=match):
        input_layouts(strategies, shapes, MESH_2X2)


def test_input_layouts_refuse_partial_and_foreign_axes():
    partial = plait.Layout((2, 2), ("dp", "tp"))("dp").with_partial(["tp"])
    with pytest.raises(LayoutError, match="holds a partial sum"):
        input_layouts((partial,), [(4,)], MESH_2X2)
    other = plait.Layout((4,), ("dp",))("dp")
    with pytest.raises(PlaitError, match="layout axis 'dp' of size 4 is not in the job's mesh"):
        input_layouts((other,), [(4,)], MESH_2X2)


def test_loader_with_slicer_loads_only_its_samples_and_cuts_other_dims():
    data = _dataset(8)
    for rank in range(4):
        slicer = InputSlicer.build(((2, 2), (2,)), [(4, 3 * 2), (4,)], MESH_2X2, rank)
        assert slicer.load_shard() == (2, MESH_2X2.coordinate(rank)[0])
    x = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    data = TensorDataset(x, torch.arange(8))
    whole = list(ShardedLoader(data, global_batch_size=4, seed=5))
    for rank in range(4):
        slicer = InputSlicer.build(((2, 2), (2,)), [(4, 6), (4,)], MESH_2X2, rank)
        loader = ShardedLoader(data, global_batch_size=4, seed=5, slicer=slicer)
        for got, glob in zip(loader, whole, strict=True):
            want = slice_batch(glob, ((2, 2), (2,)), MESH_2X2, rank)
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_slicer_loads_everything_when_inputs_split_dim0_differently():
    slicer = InputSlicer.build(((2, 1), (1,)), [(4, 6), (4,)], MESH_2X2, 2)
    assert slicer.load_shard() == (1, 0)
    x, y = _grid(4, 6), torch.arange(4)
    got = slicer.slice_loaded([x, y])
    assert torch.equal(got[0], x[2:4]) and torch.equal(got[1], y)


# for_job --------------------------------------------------------------------------------------


@dataclass
class _FakeDeviceMesh:
    coordinate: list[int]

    def get_coordinate(self) -> list[int]:
        return self.coordinate


@dataclass
class _FakeJob:
    mesh: MeshSpec | None
    config: plait.ParallelConfig = field(default_factory=plait.ParallelConfig)
    device_mesh: Any = None


def _labels(loader: ShardedLoader) -> list[list[int]]:
    return [y.tolist() for _, y in loader]


def test_for_job_stand_alone_gives_global_batches():
    job = _FakeJob(mesh=None, config=plait.ParallelConfig(mode="stand_alone"))
    loader = ShardedLoader.for_job(_dataset(), job, global_batch_size=4, seed=2)
    assert _labels(loader) == _labels(ShardedLoader(_dataset(), global_batch_size=4, seed=2))


def test_for_job_model_parallel_peers_get_identical_data():
    cfg = plait.ParallelConfig(mode="semi_auto", mesh={"dp": 2, "tp": 2})
    per_rank = []
    for rank in range(4):
        job = _FakeJob(MESH_2X2, cfg, _FakeDeviceMesh(list(MESH_2X2.coordinate(rank))))
        per_rank.append(_labels(ShardedLoader.for_job(_dataset(), job, global_batch_size=4)))
    assert per_rank[0] == per_rank[1] and per_rank[2] == per_rank[3]
    assert per_rank[0] != per_rank[2]
    whole = _labels(ShardedLoader(_dataset(), global_batch_size=4))
    assert [a + b for a, b in zip(per_rank[0], per_rank[2], strict=True)] == whole


def test_for_job_dp_axis_not_first_and_full_batch():
    mesh = MeshSpec.from_dict({"tp": 2, "dp": 2})
    cfg = plait.ParallelConfig(mode="semi_auto", mesh=mesh.as_dict())
    job = _FakeJob(mesh, cfg, _FakeDeviceMesh([0, 1]))
    loader = ShardedLoader.for_job(_dataset(), job, global_batch_size=4)
    assert (loader.sampler.dp_size, loader.sampler.dp_rank) == (2, 1)
    full = plait.ParallelConfig(
        mode="semi_auto", mesh=mesh.as_dict(), dataset_strategy="full_batch"
    )
    job = _FakeJob(mesh, full, _FakeDeviceMesh([0, 1]))
    assert ShardedLoader.for_job(_dataset(), job, global_batch_size=4).sampler.dp_size == 1


def test_for_job_per_input_strategies_uses_the_rank_of_the_coordinate():
    x = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    data = TensorDataset(x, torch.arange(8))
    strategy = ((2, 2), (2,))
    cfg = plait.ParallelConfig(mode="semi_auto", mesh={"dp": 2, "tp": 2}, dataset_strategy=strategy)
    whole = list(ShardedLoader(data, global_batch_size=4))
    job = _FakeJob(MESH_2X2, cfg, _FakeDeviceMesh([1, 0]))
    for got, glob in zip(ShardedLoader.for_job(data, job, global_batch_size=4), whole, strict=True):
        want = slice_batch(glob, strategy, MESH_2X2, 2)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_for_job_under_simulated_ranks_gives_global_batches_that_train_like_one_device():
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    reference = nn.Linear(3, 1)
    reference.load_state_dict(model.state_dict())
    data = TensorDataset(torch.randn(16, 3), torch.randn(16, 1))

    def loss_fn(m: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return ((m(x) - y) ** 2).mean()

    def sgd(params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.1)

    with plait.testing.simulate(4):
        cfg = plait.ParallelConfig(mode="data_parallel")
        job = plait.parallelize(model, cfg, optimizer=sgd, loss_fn=loss_fn)
        loader = ShardedLoader.for_job(data, job, global_batch_size=8, seed=1)
        assert loader.sampler.dp_size == 1
        losses = [job.step(batch) for batch in loader]
    opt = sgd(reference.parameters())
    expected = []
    for batch in ShardedLoader(data, global_batch_size=8, seed=1):
        opt.zero_grad()
        loss = loss_fn(reference, batch)
        loss.backward()
        opt.step()
        expected.append(loss.item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected))
