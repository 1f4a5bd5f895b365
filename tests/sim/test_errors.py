"""Bad input is refused by parallelize with a clear error, before any collective runs.

One test per rule. Each runs under a simulated world with ``CommDebugMode`` active and checks
that no collective was issued before the error.
"""

import contextlib

import pytest
import torch
from torch import nn
from torch.distributed.tensor.debug import CommDebugMode

import plait
from plait import (
    ConfigError,
    Layout,
    LayoutError,
    NotBuiltError,
    ParallelConfig,
    ShardingError,
    support,
)
from plait.models import MLP, mlp_loss
from tests.sim.conftest import adamw

SEMI = ParallelConfig(mode="semi_auto", mesh={"dp": 2, "tp": 2})


@contextlib.contextmanager
def no_collectives(world=4):
    with plait.testing.simulate(world), CommDebugMode() as debug:
        yield
    assert debug.get_total_counts() == 0


def _parallelize(model, config=SEMI, world=4):
    with no_collectives(world):
        plait.parallelize(model, config, optimizer=adamw, loss_fn=mlp_loss)


def test_error_strategy_length_differs_from_tensor_rank():
    model = MLP((16, 32, 8))
    plait.shard(model.layers[0], parameter_strategy={"weight": (2, 1, 1)})
    with pytest.raises(
        ShardingError,
        match=r"layers\.0\.weight: strategy \(2, 1, 1\) has 3 entries but the tensor has 2 dims",
    ):
        _parallelize(model)


def test_error_product_of_splits_exceeds_devices():
    model = MLP((16, 32, 8))
    plait.shard(model.layers[0], parameter_strategy={"weight": (4, 2)})
    with pytest.raises(
        ShardingError,
        match=r"layers\.0\.weight: the splits of tensor multiply to 8, which exceeds the 4 devices",
    ):
        _parallelize(model)


def test_error_product_of_splits_does_not_divide_devices():
    model = MLP((18, 30, 8))
    plait.shard(model.layers[0], parameter_strategy={"weight": (3, 1)})
    with pytest.raises(ShardingError, match="multiply to 3, which does not divide the 4 devices"):
        _parallelize(model)


def test_error_dim_not_divisible_by_split():
    model = MLP((16, 30, 8))
    plait.shard(model.layers[0], parameter_strategy={"weight": (4, 1)})
    with pytest.raises(
        LayoutError,
        match=r"layers\.0\.weight: dim 0 has size 30, which does not divide into 4 pieces",
    ):
        _parallelize(model)


def test_error_two_annotations_disagree_on_a_shared_parameter():
    model = MLP((16, 16, 16))
    model.layers[1].weight = model.layers[0].weight  # tied
    plait.shard(model.layers[0], parameter_strategy={"weight": (2, 1)})
    plait.shard(model.layers[1], parameter_strategy={"weight": (1, 2)})
    with pytest.raises(
        ShardingError, match=r"layers\.1\.weight \(also reached as layers\.0\.weight\) is annotated"
    ):
        _parallelize(model)


def test_error_reannotating_a_parameter_differently():
    layer = nn.Linear(8, 8)
    plait.shard(layer, parameter_strategy={"weight": (2, 1)})
    with pytest.raises(
        ShardingError, match=r"parameter 'weight' was annotated \(2, 1\) and now \(1, 2\)"
    ):
        plait.shard(layer, parameter_strategy={"weight": (1, 2)})


def test_error_mesh_does_not_match_world_size():
    with pytest.raises(
        ConfigError, match=r"mesh=\{'dp': 2, 'tp': 4\} covers 8 devices but the world has 4 ranks"
    ):
        _parallelize(MLP(), ParallelConfig(mode="semi_auto", mesh={"dp": 2, "tp": 4}))


def test_error_alias_not_in_layout():
    with pytest.raises(
        LayoutError, match=r"mesh axis 'mp' is not in the mesh \{'dp': 2, 'tp': 2\}"
    ):
        Layout((2, 2), ("dp", "tp"))("mp", "None")


def test_error_layout_axis_not_in_job_mesh():
    model = MLP((16, 32, 8))
    plait.shard(
        model.layers[0], parameter_strategy={"weight": Layout((2, 2), ("dp", "mp"))("mp", "None")}
    )
    with pytest.raises(
        ShardingError,
        match=r"layers\.0\.weight: layout axis 'mp' of size 2 is not in the job's mesh",
    ):
        _parallelize(model)


def test_error_unknown_parameter_name():
    with pytest.raises(
        ShardingError,
        match=r"names 'w', which is not a parameter of the module; its parameters are \['bias', 'weight'\]",
    ):
        plait.shard(nn.Linear(4, 4), parameter_strategy={"w": (2, 1)})


def test_error_annotations_in_data_parallel_mode():
    model = MLP((16, 32, 8))
    plait.shard(model.layers[0], parameter_strategy={"weight": (2, 1)})
    with pytest.raises(
        ConfigError,
        match="mode is 'data_parallel', which ignores annotations; use mode='semi_auto'",
    ):
        _parallelize(model, ParallelConfig(mode="data_parallel"))


def test_error_batch_not_divisible_by_data_parallel_size():
    with plait.testing.simulate(4):
        job = plait.parallelize(MLP((16, 8)), ParallelConfig(), optimizer=adamw, loss_fn=mlp_loss)
        with (
            CommDebugMode() as debug,
            pytest.raises(
                ShardingError, match=r"dim 0 \(6\) does not divide into 4 data-parallel pieces"
            ),
        ):
            job.step((torch.randn(6, 16), torch.randn(6, 8)))
    assert debug.get_total_counts() == 0


def test_error_no_process_group():
    with pytest.raises(ConfigError, match=r"needs a process group: call plait.init\(\) first"):
        plait.parallelize(MLP(), ParallelConfig(), optimizer=adamw, loss_fn=mlp_loss)


@pytest.mark.parametrize(
    ("field", "value", "feature"),
    [
        ("micro_batches", 4, "micro-batches outside a pipeline"),
        ("offload", "parameters", "offloading parameters"),
        ("hardware", "h100", "a hardware profile outside mode 'auto'"),
        ("memory_limit", "80GiB", "a memory limit outside mode 'auto' and recompute='auto'"),
        ("search", "ilp", "search outside mode 'auto'"),
    ],
)
def test_unbuilt_feature_is_refused_by_name(field, value, feature):
    with pytest.raises(NotBuiltError, match=rf"ParallelConfig\({field}=.*{feature}.* is not built"):
        _parallelize(MLP(), ParallelConfig(**{field: value}))


def test_pipeline_needs_real_processes_and_refuses_what_is_not_built():
    with pytest.raises(ConfigError, match="needs real processes"):
        _parallelize(MLP(), ParallelConfig(mode="data_parallel", mesh={"pp": 2, "dp": 2}))
    with pytest.raises(ConfigError, match="needs real processes"):  # a plan with stages too
        _parallelize(MLP(), ParallelConfig(mode="auto", mesh={"pp": 2, "dp": 2}))


def test_parameter_server_on_simulated_ranks_is_refused_naming_the_launch_it_needs():
    with pytest.raises(ConfigError) as e:
        _parallelize(MLP(), ParallelConfig(mode="parameter_server"))
    text = str(e.value)
    assert "needs server ranks" in text and "simulate has none" in text
    assert "plait run --worker-num W --server-num S" in text and "PLAIT_SERVER_NUM" in text


def test_parameter_server_dense_part_beyond_data_parallel_is_refused_by_name():
    cfg = ParallelConfig(mode="parameter_server", recompute="full")
    with pytest.raises(NotBuiltError, match=r"ParallelConfig\(recompute='full'\) with mode="):
        support.check(cfg)
    support.check(ParallelConfig(mode="parameter_server", optimizer_shard=3))  # ZeRO runs


def test_stand_alone_refuses_memory_passes_and_points_to_data_parallel():
    with pytest.raises(NotBuiltError, match="use mode 'data_parallel' on one process"):
        _parallelize(MLP(), ParallelConfig(mode="stand_alone", recompute="full"))


# ----------------------------------------------------------- settings that would do nothing


def test_error_unknown_and_unbuilt_config_fields_are_named():
    with pytest.raises(NotBuiltError, match=r"ParallelConfig\(context_parallel=...\): context"):
        ParallelConfig(mode="auto", context_parallel=True)
    # built as a mark on the model: the error says where
    with pytest.raises(ConfigError, match=r"did you mean plait\.annotate\.megatron\(model, tp, seq"):
        ParallelConfig(mode="semi_auto", sequence_parallel=True)
    with pytest.raises(ConfigError, match=r"unknown field 'parallel_mode'; did you mean mode\?"):
        ParallelConfig(parallel_mode="auto")
    with pytest.raises(ConfigError, match=r"unknown field 'micro_batch'; did you mean micro_batch"):
        ParallelConfig(micro_batch=4)


@pytest.mark.parametrize("mode", ["data_parallel", "semi_auto", "auto"])
def test_error_a_schedule_on_one_stage_is_refused(mode):
    config = ParallelConfig(mode=mode, mesh={"dp": 4}, schedule="zero_bubble")
    with pytest.raises(ConfigError, match=r"schedule='zero_bubble'\): a schedule on a job with"):
        _parallelize(MLP((16, 32, 8)), config)


def test_a_schedule_with_the_mesh_left_to_the_planner_is_kept():
    """Mode auto on a free mesh may choose pipeline stages: the schedule is for them."""
    config = ParallelConfig(mode="auto", schedule="zero_bubble")
    with plait.testing.simulate(4):
        plait.parallelize(
            MLP((16, 32, 8)),
            config,
            optimizer=adamw,
            loss_fn=mlp_loss,
            example_batch=(torch.randn(8, 16), torch.randn(8, 8)),
        )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("mesh", {"dp": 4}),
        ("mode", "semi_auto"),
        ("recompute", "full"),
        ("schedule", "gpipe"),
        ("search", "ilp"),
    ],
)
def test_error_a_plan_file_beside_a_different_setting(tmp_path, field, value):
    """A plan runs as it was made: a config field saying otherwise would be ignored."""
    model = MLP((16, 32, 8))
    batch = (torch.randn(8, 16), torch.randn(8, 8))
    made = plait.plan(
        model, ParallelConfig(mode="auto", mesh={"dp": 2, "tp": 2}), example_batch=batch,
        loss_fn=mlp_loss,
    )  # fmt: skip
    path = tmp_path / "plan.json"
    made.save(path)
    config = ParallelConfig(**{"mode": "auto", "plan": str(path), field: value})
    with pytest.raises(ConfigError, match=rf"ParallelConfig\(plan=..., {field}="), no_collectives():
        plait.parallelize(model, config, optimizer=adamw, loss_fn=mlp_loss, example_batch=batch)
