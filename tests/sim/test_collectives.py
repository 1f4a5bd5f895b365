"""Collective accounting: the exact collectives of one training step, per kind and mesh axis.

Counted twice, by ``CommDebugMode`` (kinds) and by plait's ``CollectiveLog`` (kinds per axis),
and the two must agree, so a silent extra redistribution fails these tests.
"""

import copy
from collections import Counter

from torch.distributed.tensor.debug import CommDebugMode

import plait
from plait import ParallelConfig
from plait.models import annotate_megatron, gpt_loss, mlp_loss
from plait.testing.comm import CollectiveLog
from plait.testing.equivalence import assert_same_run, parallel_steps, reference_run
from tests.sim.conftest import adamw, sgd


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
    backward all-reduces the input gradients of the column-parallel ones once per value they
    read: q, k and v read the same normalised input, whose gradient is summed over its three
    readers first and reduced once (the plan pins each gradient to its producer's layout), and
    fc1's input once.
    dp: one fused all-reduce per gradient bucket (the default 25 MB bucket holds this whole
    model, the position table's gradient too: its output's gradient stays pending over dp into
    it), one for the loss value step() returns and one for the global count of the targets
    the mean cross-entropy divides by (exact with ignored targets).
    """
    model, batches = gpt_and_batches
    annotate_megatron(model, 2)
    counts = _one_step(
        model, ParallelConfig(mode="semi_auto", mesh={"dp": 2, "tp": 2}), gpt_loss, batches[0], 4
    )
    assert counts == {("all_reduce", "tp"): 2 + 2, ("all_reduce", "dp"): 1 + 2}


def test_tp4_gpt_step_has_no_data_parallel_traffic(gpt_and_batches):
    """dp=1 x tp=4: only the four tensor-parallel all-reduces; nothing on the size-1 dp axis."""
    model, batches = gpt_and_batches
    annotate_megatron(model, 4)
    counts = _one_step(
        model, ParallelConfig(mode="semi_auto", mesh={"dp": 1, "tp": 4}), gpt_loss, batches[0], 4
    )
    assert counts == {("all_reduce", "tp"): 4}


def test_data_parallel_mlp_step_collectives(mlp_and_batches):
    """One fused all-reduce for all gradients (one default bucket) and one for the loss value."""
    model, batches = mlp_and_batches
    counts = _one_step(model, ParallelConfig(mode="data_parallel"), mlp_loss, batches[0], 4)
    assert counts == {("all_reduce", "dp"): 1 + 1}


def test_row_parallel_out_strategy_reduce_scatters(mlp_and_batches):
    """MindSpore's ((A * B, C),) output: the row-parallel partial sum is reduce-scattered.

    The value leaves layers.1 split four ways over (dp, tp): the plan reduces its pending sum
    with one reduce-scatter over tp (not an all-reduce), the program issues exactly it, and
    training equals one device.
    """
    model, batches = mlp_and_batches
    plait.shard(model.layers[0], parameter_strategy={"weight": (2, 1)})
    plait.shard(model.layers[1], parameter_strategy={"weight": (1, 2)}, out_strategy=((4, 1),))
    expected = reference_run(model, mlp_loss, sgd, batches)
    with plait.testing.simulate(4):
        job = plait.parallelize(
            copy.deepcopy(model),
            ParallelConfig(mode="semi_auto", mesh={"dp": 2, "tp": 2}),
            optimizer=sgd,
            loss_fn=mlp_loss,
            example_batch=batches[0],
        )
        planned = [c for c in job.loss_fn.plan.collectives if "linear_1" in c.reason]
        assert [(c.kind, c.axes) for c in planned][:1] == [("reduce_scatter", ("tp",))]
        program = Counter((c.kind, c.axis) for c in job.program.collectives())
        assert program[("reduce_scatter", "tp")] == 1
        # no tp all-reduce of the value: the program's one over tp sums the gradients of the
        # parameters pending over dp and tp (read by ops after the split), together, before
        # their bucket's sum over dp, as the plan lists
        first = [c for c in job.loss_fn.plan.collectives
                 if c.axes == ("tp",) and "pending there too" in c.reason]  # fmt: skip
        assert program[("all_reduce", "tp")] == len(first) == 1
        actual = parallel_steps(job, batches)
    assert_same_run(expected, actual, rtol=1e-5, atol=1e-6)
