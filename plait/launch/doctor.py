"""Check a cluster before training: every rank reachable, the same software everywhere, and
what each collective and each link costs.

Run it as the job's program, with the flags the training will use::

    plait run --worker-num 8 --master-addr node0 -m plait.launch.doctor

Every rank joins (``plait.init``: a rank that cannot reach the others fails the rendezvous
with the launcher's own error), then:

1. the ranks exchange what they run (host, Python, torch and plait versions, backend, device);
   ranks whose versions differ from rank 0's are refused by name (:func:`version_problems`),
   with the versions side by side, before anything else is timed;
2. each collective (all-reduce, all-gather, reduce-scatter, broadcast) is timed over the whole
   world at a few sizes (median of ``--repeats`` after a warm-up call): seconds and the bus
   bandwidth it reaches (the bytes a ring moves per rank over the time: NCCL-tests'
   definition);
3. every link from rank 0 is timed: a send and its reply between rank 0 and each other rank
   (half the round trip), so a slow node or NIC shows by itself.

Rank 0 prints the tables; the exit code is 0, or 2 where versions differ.
"""

from __future__ import annotations

import argparse
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["Examination", "Facts", "examine", "main", "version_problems"]

SIZES = (4 << 10, 256 << 10, 4 << 20)
"""Bytes per rank each collective is timed at (float32 tensors)."""


@dataclass(frozen=True, slots=True)
class Facts:
    """What one rank runs."""

    rank: int
    host: str
    python: str
    torch: str
    plait: str
    backend: str
    device: str


def version_problems(facts: Sequence[Facts]) -> list[str]:
    """One line per rank whose Python, torch or plait version differs from rank 0's."""
    first = facts[0]
    out = []
    for f in facts[1:]:
        differ = [
            f"{what} {getattr(f, what)} (rank 0: {getattr(first, what)})"
            for what in ("python", "torch", "plait")
            if getattr(f, what) != getattr(first, what)
        ]
        if differ:
            out.append(
                f"rank {f.rank} on {f.host} runs " + ", ".join(differ) + ": install the same "
                "versions on every node (a mismatch can hang or corrupt collectives)"
            )
    return out


def _facts(device: str) -> Facts:
    from plait import __version__

    return Facts(
        rank=dist.get_rank(),
        host=socket.gethostname(),
        python=platform.python_version(),
        torch=torch.__version__,
        plait=__version__,
        backend=str(dist.get_backend()),
        device=device,
    )


def _median_seconds(run: Callable[[], None], repeats: int) -> float:
    run()  # warm-up: connections and buffers
    times = []
    for _ in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _collectives(
    nbytes: int, world: int, device: torch.device
) -> dict[str, tuple[Callable[[], None], float]]:
    """Each collective at ``nbytes`` per rank, with the bytes a ring moves per rank for it."""
    n = max(world, nbytes // 4 // world * world)  # elements, divisible by the world
    x = torch.ones(n, device=device)
    gathered = torch.empty(n * world, device=device)
    scattered = torch.empty(n // world, device=device)
    ring = (world - 1) / world
    return {
        "all_reduce": (lambda: dist.all_reduce(x), 2 * ring * n * 4),
        "all_gather": (lambda: dist.all_gather_into_tensor(gathered, x), ring * n * world * 4),
        "reduce_scatter": (lambda: dist.reduce_scatter_tensor(scattered, x), ring * n * 4),
        "broadcast": (lambda: dist.broadcast(x, 0), n * 4),
    }


def _link(peer: int, nbytes: int, repeats: int, device: torch.device) -> float | None:
    """Half the round trip of ``nbytes`` between rank 0 and ``peer`` (rank 0's measure)."""
    x = torch.ones(max(1, nbytes // 4), device=device)
    rank = dist.get_rank()
    if rank not in (0, peer):
        return None

    def there_and_back() -> None:
        if rank == 0:
            dist.send(x, peer)
            dist.recv(x, peer)
        else:
            dist.recv(x, 0)
            dist.send(x, 0)

    there_and_back()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        there_and_back()
        times.append(time.perf_counter() - started)
    return statistics.median(times) / 2


@dataclass(frozen=True, slots=True)
class Examination:
    """What :func:`examine` found (the same on every rank, but ``links``: rank 0's)."""

    facts: tuple[Facts, ...]
    problems: tuple[str, ...]
    collectives: tuple[tuple[str, int, float, float], ...]
    """(kind, bytes per rank, median seconds, bus bandwidth in bytes per second)."""
    links: tuple[tuple[int, str, float], ...]
    """(peer rank, its host, seconds one way) for every link from rank 0."""

    def text(self) -> str:
        lines = [f"plait doctor: {len(self.facts)} ranks reachable"]
        for f in self.facts:
            lines.append(
                f"  rank {f.rank}: {f.host}, Python {f.python}, torch {f.torch}, plait "
                f"{f.plait}, {f.backend}, {f.device}"
            )
        if self.problems:
            lines.append("plait doctor: versions differ:")
            lines += [f"  {p}" for p in self.problems]
            return "\n".join(lines) + "\n"
        lines.append("| collective | bytes per rank | median ms | bus bandwidth GB/s |")
        lines.append("|---|---:|---:|---:|")
        for kind, nbytes, seconds, bandwidth in self.collectives:
            lines.append(f"| {kind} | {nbytes:,} | {seconds * 1e3:.3f} | {bandwidth / 1e9:.3f} |")
        if self.links:
            lines.append("| link | host | one way ms (rank 0's measure) |")
            lines.append("|---|---|---:|")
            for peer, host, seconds in self.links:
                lines.append(f"| 0 -> {peer} | {host} | {seconds * 1e3:.3f} |")
        return "\n".join(lines) + "\n"


def examine(sizes: Sequence[int] = SIZES, repeats: int = 5) -> Examination:
    """The checks of the module docstring, on every rank of an initialised world."""
    world = dist.get_world_size()
    backend = str(dist.get_backend())
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if backend == "nccl"
        else torch.device("cpu")
    )
    everyone: list[Facts | None] = [None] * world
    dist.all_gather_object(everyone, _facts(str(device)))
    facts = tuple(f for f in everyone if f is not None)
    problems = tuple(version_problems(facts))
    if problems:  # nothing timed on a mismatched cluster
        return Examination(facts, problems, (), ())
    timed = []
    for nbytes in sizes:
        for kind, (run, moved) in _collectives(nbytes, world, device).items():
            seconds = _median_seconds(run, repeats)
            timed.append((kind, nbytes, seconds, moved / seconds if seconds > 0 else 0.0))
    links = []
    for peer in range(1, world):
        dist.barrier()
        one_way = _link(peer, sizes[-1], repeats, device)
        if dist.get_rank() == 0 and one_way is not None:
            links.append((peer, facts[peer].host, one_way))
    dist.barrier()
    return Examination(facts, problems, tuple(timed), tuple(links))


def main(argv: Sequence[str] | None = None) -> int:
    import plait

    parser = argparse.ArgumentParser(prog="python -m plait.launch.doctor", description=__doc__)
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per measure")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats} must be >= 1")
    plait.init()
    found = examine(repeats=args.repeats)
    if dist.get_rank() == 0:
        sys.stdout.write(found.text())
        sys.stdout.flush()
    return 2 if found.problems else 0


if __name__ == "__main__":
    sys.exit(main())
