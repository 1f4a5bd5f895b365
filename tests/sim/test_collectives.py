"""Collective accounting: the exact collectives of one training step, per kind and mesh axis.

Counted twice, by ``CommDebugMode`` (kinds) and by plait's ``CollectiveLog`` (kinds per axis),
and the two must agree, so a silent extra redistribution fails these tests.
"""

from torch.distributed.tensor.debug import CommDebugMode

import plait
from plait import ParallelConfig
from plait.models import annotate_megatron, gpt_loss, mlp_loss
from plait.testing.comm import CollectiveLog
from tests.sim.conftest import adamw


def _one_step(model, config, loss_fn, batch, world):
    with plait.testing.simulate(world):
        job = plait.parallelize(model, config, optimizer=adamw, loss_fn=loss_fn)
        job.step(batch)  # warm-up: the first step may build caches, never collectives of its own
        with CommDebugMode() as debug, CollectiveLog(job.device_mesh) as log:
            job.step(batch)
    assert debug.get_total_counts() == log.total()
    return log.counts()


def test_megatron_gpt_step_collectives(gpt_and_batches):
    """dp=2 x tp=2, one block.

    tp: forward all-reduces the partial sums of the two row-parallel Linears (attn.out, fc2);
    backward all-reduces the input gradients of the four column-parallel ones (q, k, v, fc1).
    dp: one fused all-reduce per gradient bucket (the default 25 MB bucket holds this whole
    model), one for the loss value step() returns, one for the global count of the targets
    the mean cross-entropy divides by (plait.comm.dispatch: exact with ignored targets), and
    one inside DTensor's cross-entropy backward (its total weight, computed even for
    reduction="none").
    """
    model, batches = gpt_and_batches
    annotate_megatron(model, 2)
    counts = _one_step(
        model, ParallelConfig(mode="semi_auto", mesh={"dp": 2, "tp": 2}), gpt_loss, batches[0], 4
    )
    assert counts == {("all_reduce", "tp"): 2 + 4, ("all_reduce", "dp"): 1 + 3}


def test_tp4_gpt_step_has_no_data_parallel_traffic(gpt_and_batches):
    """dp=1 x tp=4: only the six tensor-parallel all-reduces; nothing on the size-1 dp axis."""
    model, batches = gpt_and_batches
    annotate_megatron(model, 4)
    counts = _one_step(
        model, ParallelConfig(mode="semi_auto", mesh={"dp": 1, "tp": 4}), gpt_loss, batches[0], 4
    )
    assert counts == {("all_reduce", "tp"): 6}


def test_data_parallel_mlp_step_collectives(mlp_and_batches):
    """One fused all-reduce for all gradients (one default bucket) and one for the loss value."""
    model, batches = mlp_and_batches
    counts = _one_step(model, ParallelConfig(mode="data_parallel"), mlp_loss, batches[0], 4)
    assert counts == {("all_reduce", "dp"): 1 + 1}


def test_row_parallel_out_strategy_reduce_scatters(mlp_and_batches):
    """MindSpore's ((A * B, C),) output: the row-parallel partial sum is reduce-scattered.

    The next (unannotated) Linear keeps the producer's split, so its batch stays split four
    ways over (dp, tp) and needs no all-gather.
    """
    model, batches = mlp_and_batches
    plait.shard(model.layers[0], parameter_strategy={"weight": (2, 1)})
    plait.shard(model.layers[1], parameter_strategy={"weight": (1, 2)}, out_strategy=((4, 1),))
    with plait.testing.simulate(4):
        job = plait.parallelize(
            model,
            ParallelConfig(mode="semi_auto", mesh={"dp": 2, "tp": 2}),
            optimizer=adamw,
            loss_fn=mlp_loss,
        )
        with CollectiveLog(job.device_mesh) as log:
            out = job.model(job.shard_batch(batches[0])[0])
        assert [str(p) for p in out.placements] == ["S(0)", "S(0)"]
    assert log.counts() == {("reduce_scatter", "tp"): 1}
