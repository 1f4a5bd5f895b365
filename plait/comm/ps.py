"""The parameter server's transport: one gloo process group over workers and servers.

A parameter-server job (``mode="parameter_server"``, :mod:`plait.ps`) has two kinds of ranks:
``W`` workers (global ranks ``0..W-1``), which train and form the job's default process group
among themselves, and ``S`` servers (ranks ``W..W+S-1``), which hold the embedding tables and
never join the default group. Workers and servers talk over a second group of all ``W + S``
ranks, built here on the job's store (c10d's ``ProcessGroupGloo``, point to point: a server
answers whichever worker calls, ``recv_anysource``). Gloo, not NCCL, whatever the workers
train on: the tables live in host memory, as MindSpore's servers keep them.

A message is a header (:class:`Header`, seven int64 fields) and its payload tensors, sent in
order on two tags (headers on one, payloads on the other) so a server's "from anyone" receive
only ever matches a header. Between one pair of ranks gloo keeps messages in order.

The group is process-wide, like torch's default group: :func:`join` makes it once (every rank
of the job at once: its construction connects them all), :func:`group` returns it.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import astuple, dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Header", "Kind", "PsGroup", "agree", "answer", "group", "join", "leave", "request"]

HEADER_TAG = 1
PAYLOAD_TAG = 2
REPLY_TAGS = range(16, 16 + 4096)
"""Tags of pull replies: each pull names its own (``Header.extra``), so a worker with a
prefetch outstanding matches every reply to its request, whatever order servers answer in."""

IDLE_TIMEOUT = timedelta(hours=24)
"""How long a server waits for the next message: a worker may evaluate or save for a long
time between steps. A worker that dies is seen by the launcher, which stops the servers."""


class Kind(enum.IntEnum):
    """What a message asks."""

    CREATE = 1
    """A table's spec (pickled bytes): every worker sends it, the server checks they agree."""
    INIT = 2
    """Initial rows of a table, from worker 0 (``extra``: the first local row)."""
    PULL = 3
    """Rows by local index (``extra``: the reply's tag); answered with the rows' version and
    the rows, once the table may be read at ``step``."""
    PUSH = 4
    """A worker's row gradients of one step, by local index (``extra``: 1 when its step read
    the table at all)."""
    DONE = 5
    """The worker leaves; a server stops when every worker has."""
    SAVE = 6
    """Write every table's rows and optimizer states into a directory (payload: its path),
    once ``step`` is applied; answered with a status."""
    LOAD = 7
    """Read every table's rows and optimizer states from a directory; answered with a status."""


@dataclass(frozen=True, slots=True)
class Header:
    """A message's fixed part."""

    kind: Kind
    table: int = 0
    """The table's id (:func:`plait.ps.table.table_id`)."""
    step: int = 0
    """The worker's step counter when it sent the message."""
    count: int = 0
    """Rows (or bytes, for CREATE) in the payload."""
    extra: int = 0

    def tensor(self) -> torch.Tensor:
        return torch.tensor([int(v) for v in astuple(self)], dtype=torch.int64)

    @staticmethod
    def of(t: torch.Tensor) -> Header:
        kind, table, step, count, extra = (int(v) for v in t.tolist())
        return Header(Kind(kind), table, step, count, extra)


HEADER_FIELDS = 5


class PsGroup:
    """The group of every worker and server, and the messages sent over it."""

    def __init__(self, pg: Any, rank: int, workers: int, servers: int) -> None:
        self.pg = pg
        self.rank = rank
        self.workers = workers
        self.servers = servers

    def server_rank(self, server: int) -> int:
        """Global rank of server ``server`` (0-based)."""
        return self.workers + server

    def send(self, dst: int, header: Header, payload: Sequence[torch.Tensor] = ()) -> list[Any]:
        """Start sending a message to ``dst``; returns the works to wait on (the tensors must
        live until then)."""
        head = header.tensor()
        works = [self.pg.send([head], dst, HEADER_TAG)]
        works += [self.pg.send([t.contiguous()], dst, PAYLOAD_TAG) for t in payload]
        works.append(_Keep(head, payload))
        return works

    def reply(self, dst: int, *payload: torch.Tensor, tag: int = PAYLOAD_TAG) -> list[Any]:
        """Start sending payload tensors alone (an answer the receiver waits for)."""
        works = [self.pg.send([t.contiguous()], dst, tag) for t in payload]
        return [*works, _Keep(payload)]

    def recv_header(self) -> tuple[int, Header]:
        """The next message's header from any rank, and who sent it."""
        head = torch.empty(HEADER_FIELDS, dtype=torch.int64)
        work = self.pg.recv_anysource([head], HEADER_TAG)
        work.wait(IDLE_TIMEOUT)
        return int(work._source_rank()), Header.of(head)

    def recv_payload(self, src: int, out: torch.Tensor) -> torch.Tensor:
        """Receive the next payload tensor from ``src`` into ``out``."""
        self.pg.recv([out], src, PAYLOAD_TAG).wait()
        return out

    def start_recv(self, src: int, out: torch.Tensor, tag: int = PAYLOAD_TAG) -> Any:
        """Start receiving a payload from ``src`` into ``out``; returns the work."""
        return self.pg.recv([out], src, tag)


def encode(text: str) -> torch.Tensor:
    """``text`` as a payload (utf-8 bytes)."""
    raw = text.encode()
    if not raw:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def decode(t: torch.Tensor) -> str:
    return t.numpy().tobytes().decode()


def request(ps: PsGroup, header: Header, text: str) -> list[str]:
    """Send ``header`` with ``text`` to every server and wait for their answers: each
    server's error, or nothing when all succeeded."""
    works: list[Any] = []
    for s in range(ps.servers):
        works += ps.send(ps.server_rank(s), header, [encode(text)])
    wait_all(works)
    errors = []
    for s in range(ps.servers):
        status = ps.recv_payload(ps.server_rank(s), torch.empty(2, dtype=torch.int64))
        if int(status[1]):
            message = ps.recv_payload(
                ps.server_rank(s), torch.empty(int(status[1]), dtype=torch.uint8)
            )
            errors.append(decode(message))
    return errors


def answer(ps: PsGroup, dst: int, error: str | None) -> None:
    """A server's answer to :func:`request`: ok, or ``error``."""
    message = encode(error or "")
    status = torch.tensor([0 if error is None else 1, message.numel()], dtype=torch.int64)
    wait_all(ps.reply(dst, status, *([message] if message.numel() else [])))


def agree(error: str | None) -> str | None:
    """Worker 0's ``error`` on every worker (a broadcast over the workers' default group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return error
    box: list[str | None] = [error]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class _Keep:
    """Holds a message's tensors until its sends complete (waited like a work)."""

    def __init__(self, *held: Any) -> None:
        self.held = held

    def wait(self, *_: Any) -> bool:
        return True


def wait_all(works: Sequence[Any]) -> None:
    """Wait for every work."""
    for w in works:
        w.wait()


_group: PsGroup | None = None
"""The job's worker-and-server group (made once by :func:`join`). Process-wide like torch's
default group, which it stands beside."""


def join(store: Any, rank: int, workers: int, servers: int, timeout: timedelta) -> PsGroup:
    """Connect this rank to every other worker and server (all ranks call it at once)."""
    global _group
    pg = dist.ProcessGroupGloo(dist.PrefixStore("plait.ps/", store), rank, workers + servers,
                               max(timeout, IDLE_TIMEOUT))  # fmt: skip
    _group = PsGroup(pg, rank, workers, servers)
    return _group


def group() -> PsGroup | None:
    """The job's worker-and-server group; None outside a parameter-server job."""
    return _group


def leave() -> None:
    """A worker's goodbye to every server (at exit; servers stop when all workers left)."""
    global _group
    ps, _group = _group, None
    if ps is None or ps.rank >= ps.workers:
        return
    works: list[Any] = []
    for s in range(ps.servers):
        works += ps.send(ps.server_rank(s), Header(Kind.DONE))
    wait_all(works)
