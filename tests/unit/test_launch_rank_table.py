"""Unit tests of rank-table validation, and that `plait run` refuses a bad table up front."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from plait.cli import main
from plait.launch import LaunchError, load_rank_table, parse_rank_table
from plait.launch.rank_table import find_this_node

GOOD: dict[str, Any] = {
    "version": "1.0",
    "server_count": "2",
    "server_list": [
        {"server_id": "127.0.0.1", "host_nic_ip": "reserve", "device": [
            {"device_id": "0", "device_ip": "192.1.27.6", "rank_id": "0"},
            {"device_id": "1", "device_ip": "192.1.27.7", "rank_id": "1"}]},
        {"server_id": "127.0.0.2", "device": [
            {"device_id": "0", "rank_id": "2"}, {"device_id": "1", "rank_id": "3"}]},
    ],
    "status": "completed",
}  # fmt: skip


def table_with(edit) -> dict[str, Any]:
    data = copy.deepcopy(GOOD)
    edit(data)
    return data


def test_rank_table_good() -> None:
    table = parse_rank_table(GOOD, check_hosts=True)
    assert (table.world_size, table.num_nodes, table.local_world_size) == (4, 2, 2)
    assert table.locate(3) == (1, 1, 1)
    assert find_this_node(table, is_local=lambda host: host == "127.0.0.2") == 1


def _dup_rank(d: dict) -> None:
    d["server_list"][1]["device"][0]["rank_id"] = "1"


def _missing_device_id(d: dict) -> None:
    del d["server_list"][0]["device"][1]["device_id"]


def _missing_server_list(d: dict) -> None:
    del d["server_list"]


def _gap_in_ranks(d: dict) -> None:
    d["server_list"][1]["device"][1]["rank_id"] = "7"


def _server_count(d: dict) -> None:
    d["server_count"] = "3"


def _unknown_host(d: dict) -> None:
    d["server_list"][1]["server_id"] = "no-such-host.invalid"


def _bad_device_ip(d: dict) -> None:
    d["server_list"][0]["device"][0]["device_ip"] = "not-an-ip"


def _dup_device(d: dict) -> None:
    d["server_list"][0]["device"][1]["device_id"] = "0"


def _out_of_order(d: dict) -> None:
    d["server_list"].reverse()


def _uneven(d: dict) -> None:
    d["server_list"][1]["device"].pop()
    d["server_list"][0]["device"].append({"device_id": "2", "rank_id": "3"})


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_dup_rank, r"rank_id 1 is duplicated: on server '127.0.0.1' .* and on server '127.0.0.2'"),
        (_missing_device_id, r"server_list\[0\].device\[1\] is missing 'device_id'"),
        (_missing_server_list, r"missing 'server_list'"),
        (_gap_in_ranks, r"must carry ranks 0..3; missing \[3\], out of range \[7\]"),
        (_server_count, r"'server_count' is 3 but 'server_list' has 2 servers"),
        (_unknown_host, r"'no-such-host.invalid' .* is an unknown host"),
        (_bad_device_ip, r"device_ip 'not-an-ip' is not an IP address"),
        (_dup_device, r"device_id 0 appears twice on server '127.0.0.1'"),
        (_out_of_order, r"server i must hold ranks"),
        (_uneven, r"has 1 devices but server_list\[0\] has 3"),
    ],
)
def test_rank_table_errors_name_field_and_fix(edit, message: str) -> None:
    with pytest.raises(LaunchError, match=message):
        parse_rank_table(table_with(edit), check_hosts=True)


def test_rank_table_file_errors(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="cannot be read"):
        load_rank_table(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(LaunchError, match="is not valid JSON"):
        load_rank_table(bad)


def test_rank_table_this_host_must_be_listed() -> None:
    table = parse_rank_table(GOOD)
    with pytest.raises(LaunchError, match="is not one of the servers"):
        find_this_node(table, is_local=lambda host: False)
    with pytest.raises(LaunchError, match="Pass --node-rank"):
        find_this_node(table)  # both servers are loopback addresses: ambiguous


def test_rank_table_refused_before_any_worker_starts(tmp_path: Path, capsys) -> None:
    path = tmp_path / "table.json"
    path.write_text(json.dumps(table_with(_dup_rank)))
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')\n")
    logs = tmp_path / "logs"
    code = main(["run", "--rank-table", str(path), "--node-rank", "0",
                 "--log-dir", str(logs), str(script)])  # fmt: skip
    assert code == 2
    assert "rank_id 1 is duplicated" in capsys.readouterr().err
    assert not logs.exists()


def test_rank_table_sets_the_layout(tmp_path: Path, capsys) -> None:
    path = tmp_path / "table.json"
    path.write_text(json.dumps(GOOD))
    script = tmp_path / "train.py"
    script.write_text("")
    assert main(["run", "--rank-table", str(path), "--node-rank", "1", "--dry-run",
                 "--log-dir", str(tmp_path / "logs"), str(script)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "4 workers on 2 node(s), 2 here (node rank 1)" in out
    assert "rendezvous c10d at 127.0.0.1:29500" in out
    assert "RANK=3" in out
    assert f"PLAIT_RANK_TABLE={path}" in out
    code = main(["run", "--rank-table", str(path), "--worker-num", "8", str(script)])
    assert code == 2
    assert "--worker-num 8 does not match rank table" in capsys.readouterr().err
