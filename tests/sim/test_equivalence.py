"""Parallel training equals single-device training (10 AdamW steps, fp32, rtol 1e-5).

Reference: plain PyTorch on a copy of the same model with the same global batches
(:func:`plait.testing.equivalence.reference_run`). Every rank runs in this process under
``plait.testing.simulate``; collectives compute exact results.
"""

import pytest
import torch

import plait
from plait import Layout, ParallelConfig
from plait.models import annotate_megatron, gpt_loss, mlp_loss
from plait.testing.equivalence import assert_same_run, reference_run, simulated_run
from tests.sim.conftest import adamw


def _annotate_mlp(model, weight_strategies):
    for layer, strategy in zip(model.layers, weight_strategies, strict=False):
        if strategy is not None:
            plait.shard(layer, parameter_strategy={"weight": strategy})
    return model


MLP_CASES = {
    "data_parallel_4": (ParallelConfig(mode="data_parallel"), 4, None),
    "megatron_dp2_tp2": (
        ParallelConfig(mode="semi_auto", mesh={"dp": 2, "tp": 2}),
        4,
        [(2, 1), (1, 2)],
    ),
    "tp4": (ParallelConfig(mode="semi_auto", mesh={"dp": 1, "tp": 4}), 4, [(4, 1), (1, 4)]),
}


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


@pytest.mark.parametrize("optimizer", [adamw, sgd], ids=["adamw", "sgd"])
@pytest.mark.parametrize("case", sorted(MLP_CASES))
def test_mlp_matches_single_device(case, optimizer, mlp_and_batches):
    """SGD too: Adam's update barely moves when every gradient is scaled alike, SGD's does."""
    model, batches = mlp_and_batches
    config, world, strategies = MLP_CASES[case]
    expected = reference_run(model, mlp_loss, optimizer, batches)
    if strategies:
        _annotate_mlp(model, strategies)
    assert_same_run(expected, simulated_run(model, config, mlp_loss, optimizer, batches, world))


def test_mlp_three_axis_layout_two_axes_on_one_dim_matches(mlp_and_batches):
    """Mesh dp x sp x mp on 8 ranks; fc weights split 4 ways over ("sp", "mp") on one dim."""
    model, batches = mlp_and_batches
    expected = reference_run(model, mlp_loss, adamw, batches)
    layout = Layout((2, 2, 2), ("dp", "sp", "mp"))
    plait.shard(model.layers[0], parameter_strategy={"weight": layout(("sp", "mp"), "None")})
    plait.shard(model.layers[1], parameter_strategy={"weight": layout("None", ("sp", "mp"))})
    config = ParallelConfig(mode="semi_auto", mesh={"dp": 2, "sp": 2, "mp": 2})
    assert_same_run(expected, simulated_run(model, config, mlp_loss, adamw, batches, 8))


GPT_CASES = {
    "data_parallel_4": (ParallelConfig(mode="data_parallel"), 4, None),
    "megatron_dp2_tp2": (ParallelConfig(mode="semi_auto", mesh={"dp": 2, "tp": 2}), 4, 2),
    "tp4": (ParallelConfig(mode="semi_auto", mesh={"dp": 1, "tp": 4}), 4, 4),
}


@pytest.mark.parametrize("case", sorted(GPT_CASES))
def test_gpt_matches_single_device(case, gpt_and_batches):
    model, batches = gpt_and_batches
    config, world, tp = GPT_CASES[case]
    expected = reference_run(model, gpt_loss, adamw, batches)
    if tp:
        annotate_megatron(model, tp)
    assert_same_run(expected, simulated_run(model, config, gpt_loss, adamw, batches, world))


def heads_over(model, axes: tuple[str, ...]):
    """Megatron's split on mesh dp x sp x mp with heads and MLP columns over ``axes`` (two
    axes on one dim, in that order)."""
    layout = Layout((2, 2, 2), ("dp", "sp", "mp"))
    for block in model.blocks:
        for lin in (block.attn.q, block.attn.k, block.attn.v, block.fc1):
            plait.shard(lin, parameter_strategy={"weight": layout(axes, "None")})
        for lin in (block.attn.out, block.fc2):
            plait.shard(lin, parameter_strategy={"weight": layout("None", axes)})
    return model


def test_gpt_three_axis_layout_heads_over_two_axes_matches(gpt_and_batches):
    """8 ranks, mesh dp x sp x mp; heads and MLP columns split over ("sp", "mp") together."""
    model, batches = gpt_and_batches
    expected = reference_run(model, gpt_loss, adamw, batches)
    heads_over(model, ("sp", "mp"))
    config = ParallelConfig(mode="semi_auto", mesh={"dp": 2, "sp": 2, "mp": 2})
    assert_same_run(expected, simulated_run(model, config, gpt_loss, adamw, batches, 8))


def test_stand_alone_is_plain_training(mlp_and_batches):
    model, batches = mlp_and_batches
    expected = reference_run(model, mlp_loss, adamw, batches)
    job = plait.parallelize(
        model, ParallelConfig(mode="stand_alone"), optimizer=adamw, loss_fn=mlp_loss
    )
    losses = [job.step(b) for b in batches]
    assert_same_run(expected, plait.testing.equivalence.Run(losses, job.full_state_dict()))


@pytest.mark.parametrize("mesh", [{"dp": 2, "tp": 2}, {"dp": 4, "tp": 1}], ids=["dp2_tp2", "dp4"])
def test_gpt_with_ignored_targets_matches_single_device(mesh, gpt_and_batches):
    """Padding targets (ignore_index) fall unevenly across the dp ranks, one sequence entirely:
    the mean cross-entropy still divides by the global count, as on one device (SGD shows a
    wrong gradient scale that Adam would hide)."""
    model, batches = gpt_and_batches
    torch.manual_seed(1)
    padded = []
    for ids, targets in batches:
        targets = targets.clone()
        targets[torch.rand(targets.shape) < 0.3] = -100
        targets[1] = -100
        padded.append((ids, targets))
    if mesh["tp"] > 1:
        annotate_megatron(model, mesh["tp"])
    config = ParallelConfig(mode="semi_auto", mesh=mesh)
    expected = reference_run(model, gpt_loss, sgd, padded)
    assert_same_run(expected, simulated_run(model, config, gpt_loss, sgd, padded, 4))
