"""Rank tables: a JSON description of a static cluster (MindSpore's format).

A rank table lists the servers (nodes) of a job and, per server, its devices with the global
rank each one runs. plait reads MindSpore's field names, so an existing table works as is:

```json
{
  "version": "1.0",
  "server_count": "2",
  "server_list": [
    {"server_id": "10.0.0.1",
     "device": [{"device_id": "0", "device_ip": "192.1.27.6", "rank_id": "0"},
                {"device_id": "1", "device_ip": "192.1.27.7", "rank_id": "1"}],
     "host_nic_ip": "reserve"},
    {"server_id": "10.0.0.2",
     "device": [{"device_id": "0", "rank_id": "2"}, {"device_id": "1", "rank_id": "3"}]}
  ],
  "status": "completed"
}
```

Numbers may be JSON numbers or decimal strings (MindSpore writes strings). Required:
`server_list`, and per server `server_id` (an IP address or a resolvable host name) and
`device`, and per device `device_id` and `rank_id`. Optional: `version`, `server_count` (must
equal the number of servers), `status` (must be `"completed"`), `device_ip` (must be an IP
address), `host_nic_ip` (ignored).

Rules, each checked with an error naming the field and its location:

| rule | why |
|---|---|
| rank ids are exactly 0..N-1, each once | N is the world size |
| device ids are unique within a server | one worker per device |
| server ids are unique | a node is listed once |
| every server has the same number of devices | `plait run` starts the same count per node |
| server i holds ranks i*k .. i*k+k-1 | ranks follow server order, as MindSpore requires |

What it is not: the multi-AZ format (`cluster_list`) is refused; flatten it into
`server_list`. It carries no ports: the rendezvous port is `--master-port` (default 29500).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plait.errors import LaunchError

__all__ = ["RankTable", "RankTableDevice", "RankTableServer", "load_rank_table", "parse_rank_table"]

logger = logging.getLogger(__name__)

_FIX = "See docs/launch.md, 'Rank tables', for the format."


@dataclass(frozen=True, slots=True)
class RankTableDevice:
    """One device of a server and the global rank that runs on it."""

    device_id: int
    """Device index on its server (the GPU index for CUDA)."""
    rank_id: int
    """Global rank of the worker on this device."""
    device_ip: str | None = None
    """Device network address (Ascend); informational in plait."""


@dataclass(frozen=True, slots=True)
class RankTableServer:
    """One node of the cluster."""

    server_id: str
    """Host name or IP address of the node."""
    devices: tuple[RankTableDevice, ...]
    """Devices in local-rank order (sorted by rank id)."""


@dataclass(frozen=True, slots=True)
class RankTable:
    """A validated rank table; build it with `load_rank_table` or `parse_rank_table`.

    Example:
        >>> devices = [{"device_id": "0", "rank_id": "0"}, {"device_id": "1", "rank_id": "1"}]
        >>> table = parse_rank_table({"server_list": [{"server_id": "127.0.0.1",
        ...                                            "device": devices}]})
        >>> table.world_size, table.num_nodes, table.local_world_size
        (2, 1, 2)
    """

    servers: tuple[RankTableServer, ...]
    """Servers in node-rank order."""
    source: str = "<dict>"
    """Where the table came from, for messages."""

    @property
    def world_size(self) -> int:
        """Number of ranks in the job."""
        return sum(len(s.devices) for s in self.servers)

    @property
    def num_nodes(self) -> int:
        """Number of servers."""
        return len(self.servers)

    @property
    def local_world_size(self) -> int:
        """Ranks per server (the same on every server)."""
        return len(self.servers[0].devices)

    def locate(self, rank: int) -> tuple[int, int, int]:
        """Return `(node_rank, local_rank, device_id)` of global rank `rank`."""
        if not 0 <= rank < self.world_size:
            raise LaunchError(
                f"Rank {rank!r} is not in rank table {self.source} (ranks"
                f" 0..{self.world_size - 1}). Check RANK/RANK_ID against the table."
            )
        node_rank, local_rank = divmod(rank, self.local_world_size)
        return node_rank, local_rank, self.servers[node_rank].devices[local_rank].device_id


def load_rank_table(path: str | Path, *, check_hosts: bool = True) -> RankTable:
    """Read and validate a rank table file.

    Args:
        path: JSON file in the format described in this module.
        check_hosts: also check that every `server_id` is an IP address or resolves.

    Raises:
        LaunchError: the file is missing, is not JSON, or breaks a rule.
    """
    file = Path(path)
    try:
        text = file.read_text()
    except OSError as e:
        raise LaunchError(
            f"Rank table {str(file)!r} cannot be read ({e.strerror}). Pass an existing file to"
            " --rank-table."
        ) from e
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise LaunchError(
            f"Rank table {str(file)!r} is not valid JSON: {e.msg} at line {e.lineno}, column"
            f" {e.colno}. {_FIX}"
        ) from e
    return parse_rank_table(data, source=str(file), check_hosts=check_hosts)


def parse_rank_table(data: Any, *, source: str = "<dict>", check_hosts: bool = False) -> RankTable:
    """Validate a decoded rank table (see `load_rank_table`)."""
    if not isinstance(data, Mapping):
        raise LaunchError(f"Rank table {source}: the top level must be a JSON object. {_FIX}")
    _check_top_level(data, source)
    raw_servers = _require_list(data, "server_list", source)
    servers = tuple(_parse_server(s, i, source) for i, s in enumerate(raw_servers))
    table = RankTable(servers=servers, source=source)
    _check_server_ids(table)
    _check_ranks(table)
    _check_layout(table)
    if check_hosts:
        _check_hosts_resolve(table)
    return table


def _check_top_level(data: Mapping[str, Any], source: str) -> None:
    if "cluster_list" in data:
        raise LaunchError(
            f"Rank table {source}: 'cluster_list' (the multi-AZ format) is not supported."
            " Flatten its servers into one top-level 'server_list'."
        )
    status = data.get("status", "completed")
    if status != "completed":
        raise LaunchError(
            f"Rank table {source}: 'status' is {status!r}; it must be 'completed'."
            " Finish generating the table (or drop the field)."
        )
    if "server_count" in data:
        count = _as_int(data["server_count"], "server_count", source)
        listed = len(_require_list(data, "server_list", source))
        if count != listed:
            raise LaunchError(
                f"Rank table {source}: 'server_count' is {count} but 'server_list' has {listed}"
                " servers. Make them agree."
            )


def _parse_server(raw: Any, index: int, source: str) -> RankTableServer:
    where = f"server_list[{index}]"
    if not isinstance(raw, Mapping):
        raise LaunchError(f"Rank table {source}: {where} must be an object. {_FIX}")
    server_id = raw.get("server_id")
    if not isinstance(server_id, str) or not server_id:
        raise LaunchError(
            f"Rank table {source}: {where} is missing 'server_id' (the node's host name or IP)."
            f" {_FIX}"
        )
    raw_devices = _require_list(raw, "device", source, where=where)
    devices = [_parse_device(d, f"{where}.device[{j}]", source) for j, d in enumerate(raw_devices)]
    seen: dict[int, int] = {}
    for j, dev in enumerate(devices):
        if dev.device_id in seen:
            raise LaunchError(
                f"Rank table {source}: device_id {dev.device_id} appears twice on server"
                f" {server_id!r} ({where}.device[{seen[dev.device_id]}] and {where}.device[{j}])."
                " Each device runs one worker; give each a distinct device_id."
            )
        seen[dev.device_id] = j
    return RankTableServer(server_id, tuple(sorted(devices, key=lambda d: d.rank_id)))


def _parse_device(raw: Any, where: str, source: str) -> RankTableDevice:
    if not isinstance(raw, Mapping):
        raise LaunchError(f"Rank table {source}: {where} must be an object. {_FIX}")
    for key in ("device_id", "rank_id"):
        if key not in raw:
            raise LaunchError(f"Rank table {source}: {where} is missing {key!r}. {_FIX}")
    device_ip = raw.get("device_ip")
    if device_ip is not None:
        try:
            ipaddress.ip_address(device_ip)
        except ValueError as e:
            raise LaunchError(
                f"Rank table {source}: {where}.device_ip {device_ip!r} is not an IP address."
                " Use the address from /etc/hccn.conf, or drop the field."
            ) from e
    return RankTableDevice(
        device_id=_as_int(raw["device_id"], f"{where}.device_id", source),
        rank_id=_as_int(raw["rank_id"], f"{where}.rank_id", source),
        device_ip=device_ip,
    )


def _check_server_ids(table: RankTable) -> None:
    first: dict[str, int] = {}
    for i, server in enumerate(table.servers):
        if server.server_id in first:
            raise LaunchError(
                f"Rank table {table.source}: server_id {server.server_id!r} is listed twice"
                f" (server_list[{first[server.server_id]}] and server_list[{i}])."
                " List each node once, with all its devices."
            )
        first[server.server_id] = i


def _check_ranks(table: RankTable) -> None:
    where_of: dict[int, str] = {}
    for i, server in enumerate(table.servers):
        for dev in server.devices:
            here = f"server {server.server_id!r} (server_list[{i}]) device_id {dev.device_id}"
            if dev.rank_id in where_of:
                raise LaunchError(
                    f"Rank table {table.source}: rank_id {dev.rank_id} is duplicated: on"
                    f" {where_of[dev.rank_id]} and on {here}. Each rank runs once; renumber"
                    f" ranks 0..{table.world_size - 1}."
                )
            where_of[dev.rank_id] = here
    expected = set(range(table.world_size))
    missing, extra = sorted(expected - where_of.keys()), sorted(where_of.keys() - expected)
    if missing or extra:
        raise LaunchError(
            f"Rank table {table.source}: {table.world_size} devices must carry ranks"
            f" 0..{table.world_size - 1}; missing {missing}, out of range {extra}."
            " Renumber rank_id so the ranks match the worker count."
        )


def _check_layout(table: RankTable) -> None:
    k = table.local_world_size
    for i, server in enumerate(table.servers):
        if len(server.devices) != k:
            raise LaunchError(
                f"Rank table {table.source}: server {server.server_id!r} (server_list[{i}]) has"
                f" {len(server.devices)} devices but server_list[0] has {k}. plait run starts"
                " the same number of workers on every node; list the same device count on each."
            )
    for i, server in enumerate(table.servers):
        ranks = [d.rank_id for d in server.devices]
        if ranks != list(range(i * k, (i + 1) * k)):
            raise LaunchError(
                f"Rank table {table.source}: server {server.server_id!r} (server_list[{i}]) holds"
                f" ranks {ranks}; server i must hold ranks i*{k}..i*{k}+{k - 1}, that is"
                f" {list(range(i * k, (i + 1) * k))}. Order servers by their ranks."
            )


def _check_hosts_resolve(table: RankTable) -> None:
    for i, server in enumerate(table.servers):
        if not _resolves(server.server_id):
            raise LaunchError(
                f"Rank table {table.source}: server_id {server.server_id!r} (server_list[{i}]) is"
                " an unknown host: it is not an IP address and does not resolve. Use the node's"
                " IP address or a name in DNS or /etc/hosts."
            )


def _resolves(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    try:
        socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError):
        return False
    return True


def local_host_names() -> set[str]:
    """Names and addresses under which this machine may appear in a rank table."""
    names = {"localhost", socket.gethostname(), socket.getfqdn()}
    for name in list(names):
        try:
            names.update(str(info[4][0]) for info in socket.getaddrinfo(name, None))
        except (socket.gaierror, UnicodeError):
            continue
    return names


def find_this_node(table: RankTable, *, is_local: Callable[[str], bool] | None = None) -> int:
    """Return the node rank of this machine in `table`.

    Raises:
        LaunchError: no server, or more than one, is this machine.
    """
    if is_local is None:
        names = local_host_names()

        def is_local(host: str) -> bool:
            return host in names or _is_loopback(host)

    matches = [i for i, s in enumerate(table.servers) if is_local(s.server_id)]
    listed = [s.server_id for s in table.servers]
    if not matches:
        raise LaunchError(
            f"Rank table {table.source}: this host ({socket.gethostname()!r}) is not one of the"
            f" servers {listed}. Run plait run on a listed server, or pass --node-rank to pick"
            " the entry by index."
        )
    if len(matches) > 1:
        raise LaunchError(
            f"Rank table {table.source}: servers {[listed[i] for i in matches]} all name this"
            " host. Pass --node-rank to say which entry this node is."
        )
    return matches[0]


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _require_list(
    data: Mapping[str, Any], key: str, source: str, *, where: str = "the top level"
) -> Sequence[Any]:
    value = data.get(key)
    if not isinstance(value, list) or not value:
        raise LaunchError(
            f"Rank table {source}: {where} is missing {key!r} (a non-empty list). {_FIX}"
        )
    return value


def _as_int(value: Any, where: str, source: str) -> int:
    if isinstance(value, bool):
        value = None
    if isinstance(value, int):
        result = value
    elif isinstance(value, str) and value.strip().isdigit():
        result = int(value)
    else:
        raise LaunchError(
            f"Rank table {source}: {where} is {value!r}; it must be a non-negative integer"
            " (a JSON number or a decimal string)."
        )
    if result < 0:
        raise LaunchError(f"Rank table {source}: {where} is {result}; it must be >= 0.")
    return result
