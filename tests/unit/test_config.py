"""ParallelConfig validation: each bad field names the field, the value and what is allowed."""

import pytest

from plait import CommFusion, ConfigError, ParallelConfig


def test_config_defaults_and_mesh():
    cfg = ParallelConfig(mode="semi_auto", devices=4, mesh={"dp": 2, "tp": 2})
    assert cfg.mesh_dict == {"dp": 2, "tp": 2} and cfg.data_parallel_size == 2
    assert ParallelConfig().mode == "data_parallel"
    assert ParallelConfig(devices=8).mesh_dict == {"dp": 8}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"mode": "auto_parallel"},
            r"mode='auto_parallel' is not allowed; use one of 'stand_alone'",
        ),
        ({"search": "greedy"}, r"search='greedy' is not allowed"),
        ({"devices": 0}, r"devices=0 is not allowed; use an integer >= 1"),
        ({"mesh": {"dp": 0}}, r"mesh\['dp'\]=0 is not allowed"),
        ({"mesh": {}}, r"mesh=\{\} is not allowed"),
        ({"devices": 4, "mesh": {"dp": 2, "tp": 4}}, r"has 8 devices but devices=4"),
        ({"pipeline_stages": 0}, r"pipeline_stages=0"),
        ({"micro_batches": -1}, r"micro_batches=-1"),
        ({"schedule": "zb"}, r"schedule='zb'"),
        ({"optimizer_shard": 4}, r"optimizer_shard=4 is not allowed; use 1, 2, 3 or None"),
        ({"recompute": True}, r"recompute=True"),
        ({"grad_accumulation": 1.5}, r"grad_accumulation=1.5"),
        ({"comm_fusion": 25}, r"comm_fusion=25 is not allowed"),
        ({"comm_fusion": {"mode": "index"}}, r"boundaries=\(\) is not allowed"),
        ({"offload": "gpu"}, r"offload='gpu'"),
        ({"precision": "fp8"}, r"precision='fp8'"),
        ({"hardware": "tpu"}, r"hardware='tpu'"),
        ({"memory_limit": "lots"}, r"memory_limit='lots' is not a size"),
        ({"dataset_strategy": "sharded"}, r"dataset_strategy='sharded'"),
        ({"plan": 3}, r"plan=3 is not allowed"),
        ({"dp_axis": ""}, r"dp_axis='' is not allowed"),
        ({"log_dir": 3}, r"log_dir=3 is not allowed; give a directory path"),
        ({"log_dir": ""}, r"log_dir='' is not allowed"),
        (
            {"log_dir": "runs", "log_formats": "jsonl"},
            r"log_formats='jsonl' is not allowed; give a non-empty tuple",
        ),
        ({"log_dir": "runs", "log_formats": ()}, r"log_formats=\(\) is not allowed"),
        (
            {"log_dir": "runs", "log_formats": ("csv",)},
            r"log_formats=\('csv',\) is not allowed; give a non-empty tuple of 'tensorboard', 'jsonl'",
        ),
        (
            {"log_formats": ("jsonl",)},
            r"log_formats=\('jsonl',\)\) without log_dir writes nothing; give log_dir=",
        ),
    ],
)
def test_config_invalid_field_is_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ParallelConfig(**kwargs)


def test_config_memory_limit_units():
    assert ParallelConfig(memory_limit="80GiB").memory_limit == 80 * 2**30
    assert ParallelConfig(memory_limit="512MB").memory_limit == 512 * 10**6


def test_config_comm_fusion_from_dict():
    cfg = ParallelConfig(comm_fusion={"mode": "index", "boundaries": [2, 5]})
    assert cfg.comm_fusion == CommFusion(mode="index", boundaries=(2, 5))


def test_config_log_formats_are_held_in_one_order() -> None:
    cfg = ParallelConfig(log_dir="runs", log_formats=["jsonl", "tensorboard", "jsonl"])
    assert cfg.log_formats == ("tensorboard", "jsonl") and cfg.log_dir == "runs"
    assert ParallelConfig(log_dir="runs").log_formats == ("tensorboard", "jsonl")


def test_config_is_frozen():
    cfg = ParallelConfig()
    with pytest.raises(AttributeError):
        cfg.mode = "semi_auto"  # type: ignore[misc]


def test_pipeline_stages_come_from_the_mesh_pp_axis() -> None:
    """The mesh's pp axis holds the stages: saying it once is enough."""
    assert ParallelConfig(mode="auto", mesh={"pp": 2, "dp": 2}).pipeline_stages == 2
    assert ParallelConfig(mode="auto", mesh={"dp": 4}).pipeline_stages == 1


def test_config_dp_minus_one_takes_the_rest_of_the_world() -> None:
    cfg = ParallelConfig(mode="semi_auto", mesh={"dp": -1, "tp": 2})
    assert cfg.mesh_dict == {"dp": -1, "tp": 2}  # sized by parallelize, on the world
    assert cfg.for_world(8).mesh_dict == {"dp": 4, "tp": 2}
    assert cfg.for_world(2).mesh_dict == {"dp": 1, "tp": 2}
    assert ParallelConfig(mesh={"dp": 2}).for_world(8).mesh_dict == {"dp": 2}  # nothing to size
    assert ParallelConfig(mesh={"dp": -1, "tp": 2}, devices=6).mesh_dict == {"dp": 3, "tp": 2}
    with pytest.raises(ConfigError, match=r"take 2 ranks, which does not divide 5"):
        cfg.for_world(5)
    with pytest.raises(
        ConfigError, match=r"mesh\['tp'\]=-1 is not allowed.*-1 on the data-parallel"
    ):
        ParallelConfig(mesh={"dp": 2, "tp": -1})


def test_plan_needs_devices_to_size_dp_minus_one() -> None:
    from plait.planning.setup import mesh_of

    with pytest.raises(ConfigError, match=r"dp=-1 takes the rest of the world.*give devices=N"):
        mesh_of(ParallelConfig(mode="auto", mesh={"dp": -1, "tp": 2}))
