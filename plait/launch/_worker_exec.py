"""Tiny exec shim that the launcher starts in place of each worker.

It runs as a plain script (`python _worker_exec.py [options] -- program args...`), so it
imports only the standard library and never `plait` or `torch`: a worker pays for one import
of torch, not two. It then replaces itself with the real program through `os.execv`, so the
worker keeps this process id and the elastic agent's signals and exit codes reach it
unchanged.

Options, all before `--`:

    --merge-stderr         send stderr to the same file as stdout (one log file per worker)
    --bind-core            pin this worker to its share of the launcher's CPUs (Linux)
    --env KEY=VALUE        set an environment variable (repeatable)
    --env-default KEY=VALUE  set it only when it is not already set (repeatable)

The CPU share of local rank r among n local workers is the r-th of n contiguous, near-equal
slices of the CPUs the launcher may run on (`os.sched_getaffinity(0)`).
"""

import os
import sys


def cpu_slice(cpus: list[int], local_rank: int, local_world_size: int) -> list[int]:
    """Return local rank `local_rank`'s contiguous slice of `cpus` (never empty)."""
    if local_world_size >= len(cpus):
        return [cpus[local_rank % len(cpus)]]
    start = local_rank * len(cpus) // local_world_size
    stop = (local_rank + 1) * len(cpus) // local_world_size
    return cpus[start:stop]


def _bind_core() -> None:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cpus = sorted(os.sched_getaffinity(0))
    mine = cpu_slice(cpus, local_rank, local_world_size)
    os.sched_setaffinity(0, mine)
    os.environ.setdefault("OMP_NUM_THREADS", str(len(mine)))
    os.environ["PLAIT_BOUND_CPUS"] = ",".join(str(c) for c in mine)


def main(argv: list[str]) -> None:
    if "--" not in argv:
        sys.exit("plait worker shim: expected '--' before the program to run")
    split = argv.index("--")
    options, program = argv[:split], argv[split + 1 :]
    i = 0
    bind = False
    while i < len(options):
        opt = options[i]
        if opt == "--merge-stderr":
            sys.stdout.flush()
            os.dup2(1, 2)
        elif opt == "--bind-core":
            bind = True
        elif opt in ("--env", "--env-default"):
            key, _, value = options[i + 1].partition("=")
            if opt == "--env":
                os.environ[key] = value
            else:
                os.environ.setdefault(key, value)
            i += 1
        else:
            sys.exit(f"plait worker shim: unknown option {opt!r}")
        i += 1
    if bind:
        _bind_core()
    os.execv(program[0], program)


if __name__ == "__main__":
    main(sys.argv[1:])
