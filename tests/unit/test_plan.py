"""The Plan: construction checks, byte-stable JSON round trip, summary, explain, validate.

Plans are built by hand for a two-block MLP (column-parallel fc1, row-parallel fc2, a loss
without a rule) on a dp=2 x tp=2 mesh.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import types

import pytest
import torch
from torch import nn

from plait.config import CommFusion
from plait.errors import PlaitError, PlanError
from plait.layout import TensorLayout
from plait.mesh import MeshSpec
from plait.planning import (
    Alternative,
    Plan,
    PlannedCollective,
    PlannedOp,
    PlannedParameter,
    PlanOption,
    Prediction,
)

MESH = MeshSpec.from_dict({"dp": 2, "tp": 2})


def lay(*dims: str | tuple[str, ...] | None, partial: tuple[str, ...] = ()) -> TensorLayout:
    return TensorLayout.build(MESH, dims).with_partial(partial)


def block_ops(i: int) -> list[PlannedOp]:
    prefix = f"layers.{i}"
    col = PlannedOp(
        name=f"linear_{2 * i}",
        target="aten.linear.default",
        module_path=f"{prefix}.fc1",
        strategy=((2, 1), (2, 1), (2,)),
        inputs=(lay("dp", None), lay("tp", None), lay("tp")),
        outputs=(lay("dp", "tp"),),
        label="column",
        covered=True,
        reason="annotated by user" if i == 0 else "propagated from linear_0",
        layer=prefix,
        alternatives=(
            Alternative("batch", ((4, 1), (1, 1), (1,)), 2.5e-4, "weights replicated"),
            Alternative("replicate", ((1, 1), (1, 1), (1,)), 1e-3),
        ),
    )
    relu = PlannedOp(
        name=f"relu_{i}",
        target="aten.relu.default",
        module_path=f"{prefix}.act",
        strategy=((2, 2),),
        inputs=(lay("dp", "tp"),),
        outputs=(lay("dp", "tp"),),
        label="pointwise",
        covered=True,
        reason=f"propagated from linear_{2 * i} (least redistribution cost 0.0 s)",
        layer=prefix,
    )
    row = PlannedOp(
        name=f"linear_{2 * i + 1}",
        target="aten.linear.default",
        module_path=f"{prefix}.fc2",
        strategy=((2, 2), (1, 2)),
        inputs=(lay("dp", "tp"), lay(None, "tp")),
        outputs=(lay("dp", None, partial=("tp",)),),
        label="row",
        covered=True,
        reason=f"propagated from relu_{i}",
        layer=prefix,
    )
    return [col, relu, row]


def block_params(i: int) -> list[PlannedParameter]:
    p = f"layers.{i}"
    return [
        PlannedParameter(f"{p}.fc1.weight", (32, 16), "float32", lay("tp", None), ("dp",), f"linear_{2 * i}", "column split"),
        PlannedParameter(f"{p}.fc1.bias", (32,), "float32", lay("tp"), ("dp",), f"linear_{2 * i}", "column split"),
        PlannedParameter(f"{p}.fc2.weight", (16, 32), "float32", lay(None, "tp"), ("dp",), f"linear_{2 * i + 1}", "row split"),
        PlannedParameter(f"{p}.fc2.bias", (16,), "float32", lay(None), ("dp", "tp"), "", "added after the sum"),
    ]  # fmt: skip


LOSS = PlannedOp(
    name="mse_loss",
    target="aten.mse_loss.default",
    module_path="",
    strategy=((1, 1), (1, 1)),
    inputs=(lay(None, None), lay(None, None)),
    outputs=(lay(),),
    label="replicate",
    covered=False,
    reason="no rule: replicated",
)


def toy_plan(**changes: object) -> Plan:
    ops = [*block_ops(0), *block_ops(1), LOSS]
    params = [*block_params(0), *block_params(1)]
    collectives = [
        PlannedCollective("all_reduce", ("tp",), 512, 2e-5, 1, "forward", f"linear_{k}", "row output partial over tp")
        for k in (1, 3)
    ] + [
        PlannedCollective("all_gather", ("dp",), 256, 1e-5, 2, "forward", "mse_loss", "loss reads the whole batch"),
        PlannedCollective("all_reduce", ("dp",), 1024, 4e-5, 1, "backward", "layers.0.fc1.weight", "replica gradients"),
        PlannedCollective("all_reduce", ("dp",), 1024, 4e-5, 1, "backward", "layers.1.fc1.weight", "replica gradients"),
    ]  # fmt: skip
    kw: dict[str, object] = {
        "mesh": MESH,
        "mode": "semi_auto",
        "search": "sharding_propagation",
        "hardware": "h100",
        "precision": "bf16",
        "micro_batches": 1,
        "pipeline_stages": 1,
        "optimizer_shard": None,
        "recompute": "none",
        "ops": tuple(ops),
        "parameters": tuple(params),
        "collectives": tuple(collectives),
        "predicted": Prediction(
            step_time_s=0.0125,
            compute_s=0.01,
            communication_s=0.002,
            bubble_s=0.0005,
            memory_bytes=3 * 2**30,
            memory_by_kind={
                "activations": 2**30,
                "parameters": 2**29,
                "gradients": 2**29,
                "optimizer": 2**30,
            },
            flops_per_step=1_500_000_000_000,
        ),
        "options": (
            PlanOption({"dp": 2, "tp": 2}, 1, None, "none", 0.0125, 3 * 2**30, True, "chosen"),
            PlanOption({"dp": 4}, 1, 1, "full", 0.02, 90 * 2**30, False, "over the limit"),
        ),
        "model": "ToyMLP",
        "batch": ((8, 16), (8, 16)),
        "notes": ("hand-built for tests",),
        "memory_limit": 80 * 2**30,
    }
    kw.update(changes)
    return Plan(**kw)  # type: ignore[arg-type]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(32, 16)


class ToyMLP(nn.Module):
    def __init__(self, extra: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        if extra:
            self.head = nn.Linear(16, 4)


# --------------------------------------------------------------------------- JSON


def test_round_trip_is_lossless_and_byte_identical():
    plan = toy_plan()
    text = plan.to_json()
    back = Plan.from_json(text)
    assert back == plan
    assert back.to_json() == text
    assert hash(back) == hash(plan)
    assert pickle.loads(pickle.dumps(plan)) == plan  # plans travel to worker processes
    assert back.op("linear_1").outputs[0].partial == ("tp",)
    assert back.parameter("layers.0.fc1.weight").layout.dims == (("tp",), ())


def test_run_settings_round_trip():
    """The settings a plan's batch layouts and gradient buckets assume travel with it."""
    strategies = ((2, 1), TensorLayout(MESH, (("dp",), ("tp",))))
    plan = toy_plan(
        dp_axis="tp",
        dataset_strategy=strategies,
        comm_fusion=CommFusion(mode="index", boundaries=(2,)),
    )
    back = Plan.from_json(plan.to_json())
    assert back == plan
    assert back.dataset_strategy == strategies and back.comm_fusion == plan.comm_fusion
    default = Plan.from_json(toy_plan().to_json())
    assert (default.dp_axis, default.dataset_strategy, default.comm_fusion) == (
        "dp",
        "data_parallel",
        None,
    )
    # files written before these fields existed load with the defaults
    old = json.loads(toy_plan().to_json())
    for key in ("dp_axis", "dataset_strategy", "comm_fusion"):
        del old[key]
    assert Plan.from_json(json.dumps(old)) == toy_plan()


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("dataset_strategy", "sharded", r"Plan.dataset_strategy='sharded'"),
        ("dataset_strategy", ((2, 0),), r"Plan.dataset_strategy=\(\(2, 0\),\)"),
        ("dp_axis", "", r"Plan.dp_axis=''"),
        ("comm_fusion", {"mode": "size"}, r"Plan.comm_fusion="),
    ],
)
def test_run_settings_are_checked(field, value, message):
    with pytest.raises(PlanError, match=message):
        toy_plan(**{field: value})


def test_two_builds_give_identical_files(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    toy_plan().save(a)
    toy_plan().save(b)
    assert a.read_bytes() == b.read_bytes()
    assert Plan.load(a) == toy_plan()
    # A caller's dict in another order still gives the same file: the kinds are reordered.
    kinds = {"optimizer": 2**30, "gradients": 2**29, "parameters": 2**29, "activations": 2**30}
    reordered = dataclasses.replace(toy_plan().predicted, memory_by_kind=kinds)
    assert toy_plan(predicted=reordered).to_json() == toy_plan().to_json()


def test_file_has_the_documented_fields():
    data = json.loads(toy_plan().to_json())
    required = {
        "schema_version", "mesh", "micro_batches", "optimizer_shard", "recompute", "precision",
        "ops", "parameters", "collectives", "predicted", "mode", "search", "hardware", "stages",
        "pipeline_stages", "options", "model", "batch", "notes",
    }  # fmt: skip
    assert required <= set(data)
    assert next(iter(data)) == "schema_version" and data["schema_version"] == 1
    assert list(data["mesh"].items()) == [("dp", 2), ("tp", 2)]
    assert set(data["predicted"]) == {
        "step_time_s", "compute_s", "communication_s", "bubble_s", "memory_bytes",
        "memory_by_kind", "flops_per_step", "optimizer_s", "overlapped_s",
    }  # fmt: skip
    assert list(data["predicted"]["memory_by_kind"]) == [
        "parameters",
        "gradients",
        "optimizer",
        "activations",
    ]
    op = data["ops"][0]
    assert {
        "name",
        "target",
        "module",
        "strategy",
        "inputs",
        "outputs",
        "label",
        "covered",
        "reason",
        "alternatives",
    } <= set(op)
    assert op["strategy"] == [[2, 1], [2, 1], [2]]
    assert op["inputs"][0] == {
        "dims": [["dp"], []],
        "partial": [],
        "reduce_op": "sum",
        "tensor_map": [1, -1],
    }
    assert data["ops"][2]["outputs"][0]["partial"] == ["tp"]
    assert op["alternatives"][0] == {
        "label": "batch",
        "strategy": [[4, 1], [1, 1], [1]],
        "cost_s": 0.00025,
        "note": "weights replicated",
    }
    param = data["parameters"]["layers.0.fc2.weight"]
    assert param["layout"]["dims"] == [[], ["tp"]] and param["grad_reduce_axes"] == ["dp"]
    assert data["collectives"][0] == {
        "kind": "all_reduce", "axes": ["tp"], "phase": "forward", "op": "linear_1", "value": "",
        "nbytes": 512, "seconds": 2e-05, "count": 1, "group_size": None, "reason": "row output partial over tp",
    }  # fmt: skip
    assert "\t" not in toy_plan().to_json() and toy_plan().to_json().endswith("}\n")


def _edit(change) -> str:
    data = json.loads(toy_plan().to_json())
    change(data)
    return json.dumps(data)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda d: d.update(schema_version=2), ["schema_version 2", "upgrade plait"]),
        (lambda d: d.update(schema_version=0), ["schema_version 0", "plan again"]),
        (lambda d: d.pop("schema_version"), ["no schema_version"]),
        (lambda d: d["ops"][0].update(strategy="2,1"), ["ops[0].strategy", "'2,1'"]),
        (lambda d: d["ops"][3]["inputs"][0].update(dims=[["mp"], []]), ["ops[3].inputs[0]", "'mp'"]),
        (lambda d: d["ops"][0].pop("label"), ["ops[0].label is missing"]),
        (lambda d: d["ops"][0].update(colour="red"), ["ops[0]", "unknown field", "colour"]),
        (lambda d: d["parameters"]["layers.0.fc1.weight"].update(shape=[32, "16"]), ["parameters.layers.0.fc1.weight.shape"]),
        (lambda d: d["parameters"]["layers.0.fc1.weight"]["layout"].update(tensor_map=[1, -1]), ["tensor_map", "disagrees"]),
        (lambda d: d["collectives"][0].update(kind="all_sum"), ["collectives[0]", "'all_sum'", "all_gather"]),
        (lambda d: d["predicted"].update(step_time_s=True), ["predicted.step_time_s"]),
        (lambda d: d["predicted"]["memory_by_kind"].update(activations=-1), ["memory_by_kind", "-1"]),
        (lambda d: d["mesh"].update(tp=0), ["mesh", "size 0"]),
        (lambda d: d.update(mode="turbo"), ["mode", "'turbo'", "semi_auto"]),
        (lambda d: d["options"][1].update(feasible="no"), ["options[1].feasible"]),
    ],
)  # fmt: skip
def test_malformed_files_name_the_field(change, words):
    with pytest.raises(PlanError) as err:
        Plan.from_json(_edit(change))
    for word in words:
        assert word in str(err.value)


def test_not_json_and_repeated_keys_are_plan_errors(tmp_path):
    with pytest.raises(PlanError, match=r"not valid JSON.*line 1"):
        Plan.from_json("{'mesh': 1}")
    with pytest.raises(PlanError, match="expected an object"):
        Plan.from_json("[1, 2]")
    with pytest.raises(PlanError, match="repeats the key 'mode'"):
        Plan.from_json('{"schema_version": 1, "mode": "auto", "mode": "semi_auto"}')
    path = tmp_path / "broken.json"
    path.write_text('{"schema_version": 7}')
    with pytest.raises(PlanError, match=r"broken\.json: .*schema_version 7"):
        Plan.load(path)
    with pytest.raises(PlanError, match="cannot read plan file"):
        Plan.load(tmp_path / "missing.json")


# --------------------------------------------------------------------------- construction


def test_construction_normalises_and_refuses_inconsistent_plans():
    assert toy_plan(recompute=True).recompute == "full"
    assert toy_plan(recompute=None).recompute == "none"
    kinds = {"activations": 1, "parameters": 2}
    pred = dataclasses.replace(toy_plan().predicted, memory_by_kind=kinds)
    kinds["parameters"] = 99  # the plan keeps its own copy
    assert pred.memory_by_kind == {"parameters": 2, "activations": 1}
    ops = toy_plan().ops
    with pytest.raises(PlanError, match="names 'relu_0' twice"):
        toy_plan(ops=(*ops, ops[1]))
    other = MeshSpec.from_dict({"dp": 4})
    bad_param = dataclasses.replace(
        toy_plan().parameters[0], layout=TensorLayout.replicated(other, 2)
    )
    with pytest.raises(PlanError, match=r"laid out on mesh \{'dp': 4\}"):
        toy_plan(parameters=(bad_param, *toy_plan().parameters[1:]))
    with pytest.raises(PlanError, match="which is not in the plan"):
        toy_plan(
            parameters=(dataclasses.replace(bad_param, layout=lay("tp", None), op="linear_9"),)
        )
    with pytest.raises(PlanError, match="neither an op nor a parameter"):
        toy_plan(
            collectives=(
                PlannedCollective("broadcast", ("dp",), 1, 0.0, 1, "optimizer", "nope", ""),
            )
        )
    with pytest.raises(PlanError, match="axis 'pp' is not in the mesh"):
        toy_plan(
            collectives=(
                PlannedCollective("send_recv", ("pp",), 1, 0.0, 1, "forward", "relu_0", ""),
            )
        )
    with pytest.raises(PlanError, match="2 stages but pipeline_stages=1"):
        toy_plan(stages=(("linear_0",), ("mse_loss",)))
    with pytest.raises(PlanError, match="precision='fp8'"):
        toy_plan(precision="fp8")


def test_op_and_parameter_checks():
    col = block_ops(0)[0]
    with pytest.raises(PlanError, match="disagrees with input layout"):
        dataclasses.replace(col, strategy=((2, 1), (1, 1), (2,)))
    with pytest.raises(PlanError, match="3 entries for 2 inputs"):
        dataclasses.replace(col, inputs=col.inputs[:2])
    with pytest.raises(PlanError, match="holds a partial sum"):
        dataclasses.replace(col, inputs=(lay("dp", None, partial=("tp",)), *col.inputs[1:]))
    with pytest.raises(PlanError, match="cost_s=inf"):
        Alternative("x", (), float("inf"))
    param = block_params(0)[0]
    with pytest.raises(PlanError, match=r"axes that split the parameter itself"):
        dataclasses.replace(param, grad_reduce_axes=("dp", "tp"))
    with pytest.raises(PlanError, match="has 2 dims but the shape"):
        dataclasses.replace(param, shape=(32,))
    with pytest.raises(PlanError, match="count=0"):
        PlannedCollective("all_reduce", ("dp",), 8, 1e-6, 0, "backward", "x", "")
    with pytest.raises(PlanError, match="phase='sideways'"):
        PlannedCollective("all_reduce", ("dp",), 8, 1e-6, 1, "sideways", "x", "")


# --------------------------------------------------------------------------- for people


def test_summary_states_the_key_facts():
    text = toy_plan().summary()
    for fact in [
        "plan for ToyMLP on mesh dp=2 x tp=2 (4 devices)",
        "mode semi_auto, search sharding_propagation, hardware h100, precision bf16",
        "micro-batches 1, pipeline stages 1, optimizer shard off, recompute none",
        "step time 12.50 ms: compute 10.00 ms, communication 2.00 ms, bubble 500.00 us",
        "3.00 GiB peak of 80.00 GiB limit (4%, fits)",
        "parameters 512.00 MiB, gradients 512.00 MiB, optimizer 1.00 GiB, activations 1.00 GiB",
        "FLOPs per step 1.50 TFLOP",
        "ops (7, 4 shown: repeated layers as one)",
        "[layers.0] x2",
        "layers.0 .. layers.1",
        "replicated: no rule (1 op)",
        "aten.mse_loss.default x1: 'mse_loss'",
        "hand-built for tests",
    ]:
        assert fact in text, fact
    lines = text.splitlines()
    col = next(line for line in lines if line.strip().startswith("linear_0"))
    assert "linear" in col and "layers.0.fc1" in col and "column" in col
    assert "((2, 1), (2, 1), (2,))" in col and "[dp, tp]" in col
    assert not any(line.strip().startswith("linear_2") for line in lines)  # layer 1 folded
    assert "[dp, None] P(sum)@tp" in text
    # Collectives aggregated by (kind, axes, phase): two forward tp all-reduces, 2 x 512 B.
    fwd_tp = next(line for line in lines if line.split()[:3] == ["all_reduce", "tp", "forward"])
    assert fwd_tp.split()[3:] == ["2", "1.00", "KiB", "40.00", "us"]
    gather = next(line for line in lines if line.split()[:3] == ["all_gather", "dp", "forward"])
    assert gather.split()[3:6] == ["2", "512", "B"]
    assert "over the limit" in text and "dp=4" in text


def test_a_prediction_on_the_uncalibrated_local_defaults_says_so():
    """#35 item 2: summary, explain and job.report() of a plan made on the uncalibrated
    ``local`` defaults say so and how to calibrate; a datasheet or calibrated profile's do not."""
    from plait.runtime.engine.report import RunReport, run_report

    plan = toy_plan(hardware="local", hardware_uncalibrated=True)
    summary = plan.summary()
    warning = "predicted on hardware local (UNCALIBRATED: conservative CPU defaults"
    assert warning in summary and "`plait calibrate --world-size N`" in summary
    assert summary.index(warning) < summary.index("step time 12.50 ms")  # above the numbers
    for name in ("linear_0", "layers.0.fc1.weight", "layers.1"):
        assert "times above are predicted on hardware local (UNCALIBRATED" in plan.explain(name)
    assert plan.hardware_label.startswith("local (UNCALIBRATED")
    job = types.SimpleNamespace(plan=plan)  # what job.report() reads: the job's plan
    report = run_report(job, [0.2, 0.1, 0.1], None, warmup=1)
    assert report.hardware_uncalibrated
    assert "predicted on hardware local (UNCALIBRATED" in report.table()
    # kept by the plan file; files written before the field read as not flagged
    assert Plan.from_json(plan.to_json()).hardware_uncalibrated
    data = json.loads(plan.to_json())
    del data["hardware_uncalibrated"]
    assert not Plan.from_json(json.dumps(data)).hardware_uncalibrated
    calibrated = toy_plan(hardware="local")
    for text in (calibrated.summary(), calibrated.explain("linear_0"), toy_plan().summary()):
        assert "UNCALIBRATED" not in text
    assert calibrated.hardware_label == "local"
    assert "UNCALIBRATED" not in RunReport(0.1, 0.1, 1, None, None, "not measured").table()


def test_summary_keeps_layers_that_differ_apart():
    ops = list(toy_plan().ops)
    ops[3] = dataclasses.replace(ops[3], label="batch-ish")  # layer 1's fc1 is labelled otherwise
    text = toy_plan(ops=tuple(ops)).summary()
    assert "[layers.0] x1" in text and "[layers.1] x1" in text
    assert "ops (7)" in text


def test_explain_op_parameter_and_module():
    plan = toy_plan()
    op = plan.explain("linear_0")
    assert "aten.linear.default in module layers.0.fc1, layer layers.0" in op
    assert "strategy ((2, 1), (2, 1), (2,)) (column)" in op and "annotated by user" in op
    assert "batch ((4, 1), (1, 1), (1,)): 250.00 us (weights replicated)" in op
    assert "layers.0.fc1.weight" in op
    row = plan.explain("linear_1")
    assert "forward all_reduce over tp: 512 B, 20.00 us each" in row
    param = plan.explain("layers.0.fc1.weight")
    assert "(32, 16) float32" in param and "[tp, None]" in param
    assert "(16, 16) per device" in param and "tensor_map (0, -1)" in param
    assert "gradient summed over: dp" in param and "backward all_reduce over dp" in param
    loss = plan.explain("mse_loss")
    assert "no rule in the catalogue, replicated" in loss and "none recorded" in loss
    module = plan.explain("layers.1")
    assert "module layers.1: 3 ops, 4 parameters" in module
    op_rows = [line.split()[0] for line in module.splitlines()[3:6]]
    assert op_rows == ["linear_2", "relu_1", "linear_3"] and "layers.1.fc2.bias" in module
    assert "layers.0.fc1.weight" not in module
    with pytest.raises(PlanError, match=r"close matches: .*'linear_1'"):
        plan.explain("linear_l")
    with pytest.raises(PlanError, match=r"'layers.0.fc1.weight'"):
        plan.explain("layers.0.fc1.wieght")


def test_lookups():
    plan = toy_plan()
    assert plan.op("relu_1").layer == "layers.1"
    assert plan.parameter("layers.1.fc2.bias").grad_reduce_axes == ("dp", "tp")
    with pytest.raises(PlanError, match="close matches: 'relu_1'"):
        plan.op("relu_11")
    with pytest.raises(PlanError, match=r"parameter 'fc1\.weight' is not in the plan"):
        plan.parameter("fc1.weight")


# --------------------------------------------------------------------------- validate


def test_validate_accepts_the_matching_meta_model():
    with torch.device("meta"):
        model = ToyMLP()
    toy_plan().validate(model, world_size=4)
    toy_plan().validate({n: tuple(p.shape) for n, p in model.named_parameters()})
    toy_plan(stages=(("layers.0", "linear_2"),)).validate(model)


def test_validate_names_missing_extra_and_shape_problems():
    with torch.device("meta"):
        model = ToyMLP(extra=True)
    with pytest.raises(PlanError) as err:
        toy_plan().validate(model, world_size=8)
    text = str(err.value)
    assert "2 problems" in text
    assert "has 4 devices but the world has 8" in text
    assert "without a planned layout: 'head.weight', 'head.bias'" in text
    shapes = {p.name: p.shape for p in toy_plan().parameters}
    del shapes["layers.1.fc2.bias"]
    shapes["layers.0.fc1.weight"] = (64, 16)
    with pytest.raises(PlanError) as err:
        toy_plan().validate(shapes)
    text = str(err.value)
    assert "the model does not have: 'layers.1.fc2.bias'" in text
    assert "'layers.0.fc1.weight' has shape (64, 16) in the model but (32, 16) in the plan" in text


def test_validate_refuses_indivisible_layouts_and_unknown_stages():
    params = list(toy_plan().parameters)
    params[1] = dataclasses.replace(params[1], shape=(33,))  # fc1.bias split over tp=2
    plan = toy_plan(parameters=tuple(params))
    shapes = {p.name: p.shape for p in params}
    with pytest.raises(PlanError, match=r"dim 0 has size 33, which does not divide into 2"):
        plan.validate(shapes)
    with pytest.raises(PlanError, match=r"stage 0 names 'layers.7'"):
        toy_plan(stages=(("layers.7",),)).validate({p.name: p.shape for p in toy_plan().parameters})
    with pytest.raises(PlanError, match=r"give an nn\.Module or a mapping"):
        toy_plan().validate([1, 2])


def test_plan_error_is_a_plait_error():
    assert issubclass(PlanError, PlaitError) and issubclass(PlanError, ValueError)


# --------------------------------------------------------------------------- codec


def test_codec_file_order_names_every_field_and_keys_follow_it():
    """The file form comes from the dataclass fields: every record declares all of them."""
    from plait.planning import codec

    data = codec.encode(toy_plan())
    assert list(data)[:3] == ["model", "batch", "mesh"] and list(data)[-1] == "notes"
    assert list(data["ops"][0])[:4] == ["name", "target", "module", "layer"]
    assert "name" not in data["parameters"]["layers.0.fc1.weight"]  # the key is the name
    assert list(data["collectives"][0])[:4] == ["kind", "axes", "phase", "op"]
    # every field of every record reaches the file (a field left out would not round-trip)
    for record in (toy_plan(), toy_plan().ops[0], toy_plan().predicted, toy_plan().options[0]):
        keys = set(codec.encode(record))
        fields = {f.metadata.get(codec.KEY, f.name) for f in dataclasses.fields(record) if f.init}
        assert keys == fields


def test_union_fields_are_read_by_their_json_kind():
    """dataset_strategy is a name or a list of split tuples and layouts; null is a value too."""
    layout = TensorLayout(MESH, (("dp",), ()))
    plan = toy_plan(dataset_strategy=((4, 1), layout), memory_limit=None)
    back = Plan.from_json(plan.to_json())
    assert back.dataset_strategy == ((4, 1), layout) and back.memory_limit is None
    data = json.loads(plan.to_json())
    data["dataset_strategy"] = 7
    with pytest.raises(PlanError, match=r"dataset_strategy is 7; expected a string or a list"):
        Plan.from_json(json.dumps(data))
    data["dataset_strategy"] = [[4, True]]
    with pytest.raises(PlanError, match=r"dataset_strategy\[0\]\[1\] is True"):
        Plan.from_json(json.dumps(data))
