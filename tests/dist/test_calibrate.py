"""``plait calibrate --quick``: one real run (2 gloo processes) writes a loadable profile.

The subcommand is driven through its :class:`plait.cli.Command` (flags parsed by the parser it
declares), so the test holds whether or not ``plait.cli`` has registered it yet.
"""

from __future__ import annotations

import argparse
import json

import pytest

from plait.cli.calibrate import calibrate_command
from plait.cost import Topology, collective_seconds, get_profile
from plait.mesh import MeshSpec

pytestmark = pytest.mark.dist


def test_calibrate_quick_writes_a_loadable_profile(tmp_path, capsys) -> None:
    out = tmp_path / "local.json"
    command = calibrate_command()
    assert command.name == "calibrate"
    parser = argparse.ArgumentParser(prog="plait calibrate")
    command.add_arguments(parser)
    args = parser.parse_args(["--quick", "--out", str(out), "--world-size", "2"])

    assert command.handler(args) == 0

    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and "matmul GFLOP/s" in printed
    profile = get_profile("local", out)
    assert profile.name == "local"
    assert "measured by `plait calibrate --quick`" in profile.source
    for dtype in ("float32", "bfloat16", "float16"):
        assert profile.peak(dtype) > 1e6  # any CPU does more than a MFLOP/s
    assert profile.memory_bandwidth > 1e7 and profile.memory_bytes > 2**20
    assert profile.intra_node.bandwidth > 1e6 and profile.intra_node.latency > 0
    assert 0 < profile.kernel_latency < 0.01
    # linear layers in forward and backward reach a share of the square product's rate
    assert 0 < profile.compute_efficiency <= 1 and "compute efficiency:" in printed
    assert (
        profile.compute_efficiency == json.loads(out.read_text())["measured"]["network_efficiency"]
    )
    # a captured op (a linear: view, transpose, addmm, and their backward) costs several calls
    assert 0 < profile.call_overhead < profile.op_overhead + profile.kernel_latency
    measured = json.loads(out.read_text())["measured"]
    assert len(measured["overlap_per_rank"]) == 2
    assert 0 <= min(measured["overlap_per_rank"]) <= profile.comm_overlap
    assert profile.comm_overlap <= max(measured["overlap_per_rank"]) <= 1
    assert "comm overlap:" in printed and "matmul share:" in printed
    # thin products' shares (quick: d = 32 and 128) against the square 512 one, which is 1
    assert [d for d, _ in profile.matmul_efficiency] == [32, 128, 512]
    assert all(0 < f <= 1 for _, f in profile.matmul_efficiency)
    assert profile.matmul_efficiency[-1] == (512, 1.0)
    # attention's batched products by head dimension (quick: 32 and 128), no square point
    assert [d for d, _ in profile.batched_matmul_efficiency] == [32, 128]
    assert all(0 < f <= 1 for _, f in profile.batched_matmul_efficiency)
    # the element rates of the ops whose arithmetic can outrun their bytes, by aten name
    assert {n for n, _ in profile.elementwise_rates} == {
        "gelu", "silu", "tanh", "sigmoid", "softmax", "log_softmax", "layer_norm",
        "cross_entropy_loss",
    }  # fmt: skip
    assert all(r > 1e5 for _, r in profile.elementwise_rates)  # elements/s of any CPU
    assert "batched products:" in printed and "element rates:" in printed
    # a small send's one-way time between ranks that compute between messages
    assert 0 < profile.wait_latency < 1.0 and "wait latency:" in printed
    assert len(measured["wait_latency_per_rank"]) == 2  # one pair: both of its ranks time it

    # The raw timings are kept, and the fitted link predicts the largest all_reduce within
    # a factor of 3 (a shared 2-core machine is noisy; the fit itself is tested exactly in
    # tests/unit/test_cost.py).
    raw = json.loads(out.read_text())["measured"]["all_reduce"]
    assert raw["world_size"] == 2 and len(raw["seconds"]) == len(raw["message_bytes"])
    predicted = collective_seconds("all_reduce", raw["message_bytes"][-1], 2, profile.intra_node)
    assert raw["seconds"][-1] / 3 < predicted < raw["seconds"][-1] * 3

    # Usable by the planner: a 4-rank mesh on this host is priced on the measured link.
    topo = Topology(MeshSpec.from_dict({"dp": 2, "tp": 2}), profile)
    assert topo.intra_node_axes == ("dp", "tp")
    assert topo.axis_seconds("all_reduce", "tp", 4096) > 0


def test_calibrate_refuses_a_single_process(tmp_path, capsys) -> None:
    command = calibrate_command()
    parser = argparse.ArgumentParser(prog="plait calibrate")
    command.add_arguments(parser)
    args = parser.parse_args(["--world-size", "1", "--out", str(tmp_path / "x.json")])
    assert command.handler(args) == 2
    assert "world_size=1" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
