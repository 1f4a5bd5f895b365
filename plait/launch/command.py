"""The `plait run` command line: its flags, and turning them into a `RunConfig`.

`add_run_arguments` declares the flags (msrun's, in kebab case, plus `--emit` and
`--dry-run`); `config_from_args` validates them, reads the rank table when one is given, and
returns the `RunConfig`. Printing and exit codes belong to `plait/cli/run.py`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile

from plait.errors import LaunchError
from plait.launch.config import DEFAULT_CLUSTER_TIMEOUT, RunConfig
from plait.launch.emit import EmitOptions, EmitTarget, KubernetesApi
from plait.launch.environment import DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT
from plait.launch.rank_table import RankTable, find_this_node, load_rank_table

__all__ = ["add_run_arguments", "config_from_args", "emit_options_from_args", "with_log_dir"]


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the flags of `plait run`."""
    add = parser.add_argument
    add(
        "--worker-num",
        type=int,
        help="workers in the whole job (default: --local-worker-num, or 1)",
    )
    add("--local-worker-num", type=int, help="workers on this node (default: --worker-num)")
    add(
        "--server-num",
        type=int,
        default=0,
        help="parameter servers started beside the workers, on this one node (ranks after the"
        " workers'; a job with ParallelConfig(mode='parameter_server')); default 0",
    )
    add(
        "--nnodes",
        default=None,
        metavar="N|MIN:MAX",
        help="nodes in the job; MIN:MAX makes it elastic: it trains on any count in between,"
        " re-forming when a node leaves (with --max-restarts) or joins (default: --worker-num"
        " / --local-worker-num)",
    )
    add(
        "--master-addr",
        default=None,
        help=f"host of node 0, where nodes meet (default {DEFAULT_MASTER_ADDR}; the first server"
        " of --rank-table)",
    )
    add(
        "--master-port",
        type=int,
        default=DEFAULT_MASTER_PORT,
        help=f"rendezvous port on --master-addr (default {DEFAULT_MASTER_PORT})",
    )
    add(
        "--node-rank",
        type=int,
        default=None,
        help="this node's index, 0..nodes-1; node 0 hosts the rendezvous (default: assigned"
        " in arrival order)",
    )
    add(
        "--log-dir",
        default=None,
        help="directory for worker_<rank>.log and launcher.log (default: a new temporary one)",
    )
    add(
        "--join",
        action="store_true",
        help="echo every worker's output to the console (msrun --join); plait run always waits",
    )
    add(
        "--tail-worker-log",
        default="0",
        help="ranks echoed to the console: '0,3', 'all' or 'none' (default 0)",
    )
    add(
        "--cluster-timeout",
        type=float,
        default=DEFAULT_CLUSTER_TIMEOUT,
        help=f"seconds for all nodes to join the rendezvous (default {DEFAULT_CLUSTER_TIMEOUT:g})",
    )
    add(
        "--max-restarts",
        type=int,
        default=0,
        help="restart the whole worker group up to this many times after a failure (default 0)",
    )
    add(
        "--checkpoint-dir",
        default=None,
        metavar="DIR",
        help="checkpoint directory, exported to every worker as PLAIT_CHECKPOINT_DIR: a script"
        " using plait.checkpoint.Checkpoints() saves there and, after a restart, resumes from"
        " the newest complete checkpoint",
    )
    add(
        "--hang-timeout",
        type=float,
        default=None,
        metavar="S",
        help="stop the job when a worker waits S seconds in a collective for its peers: every"
        " worker reports the collective it waits in (or, for the one that never arrived, the"
        " last it finished) and its Python stacks, into its log and hang_rank<r>.txt in"
        " --log-dir (default: no watchdog)",
    )
    add(
        "--bind-core",
        action="store_true",
        help="pin each worker to its own slice of this node's CPUs (Linux)",
    )
    add(
        "--rank-table",
        default=None,
        metavar="FILE",
        help="JSON rank table (MindSpore format) giving nodes, devices and ranks",
    )
    add("--run-id", default="plait", help="rendezvous id, the same on every node (default plait)")
    add(
        "--dry-run",
        action="store_true",
        help="print each local worker's environment and command, then exit without starting",
    )
    add(
        "--emit",
        choices=[t.value for t in EmitTarget],
        default=None,
        help="write an sbatch script or Kubernetes manifest that runs this job, then exit",
    )
    add("--output", "-o", default=None, metavar="FILE", help="where --emit writes (default stdout)")
    add("--image", default=None, help="container image for --emit kubernetes")
    add("--job-name", default="plait", help="job name for --emit: a-z, 0-9, - (default plait)")
    add(
        "--k8s-api",
        choices=[a.value for a in KubernetesApi],
        default=KubernetesApi.PYTORCHJOB.value,
        help="--emit kubernetes as a Kubeflow PyTorchJob (default) or a JobSet",
    )
    add(
        "-m",
        dest="module",
        action="store_true",
        help="run the program as a module (python -m), like torchrun -m",
    )
    add(
        "--diagnose",
        action="store_true",
        help="run plait's cluster check instead of a program (python -m plait.launch.doctor):"
        " ranks reachable, versions compared, collectives and links timed",
    )
    add("program", nargs="?", default=None, help="script to run (or module name with -m)")
    add("program_args", nargs=argparse.REMAINDER, help="arguments for the script")


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """Validate the flags of `plait run` and build its `RunConfig`.

    Raises:
        LaunchError: a flag or the rank table is invalid; nothing has started.
    """
    program = _program(args)
    table = load_rank_table(args.rank_table) if args.rank_table else None
    min_nodes, max_nodes = _nnodes(args.nnodes)
    worker_num, local_worker_num = _worker_counts(args, table, max_nodes)
    server_num, local_servers = _server_num(
        args, worker_num, local_worker_num, table, max_nodes, min_nodes
    )
    node_rank = args.node_rank
    master_addr = args.master_addr or DEFAULT_MASTER_ADDR
    if table is not None:
        if node_rank is None:
            node_rank = find_this_node(table)
        elif not 0 <= node_rank < table.num_nodes:
            raise LaunchError(
                f"--node-rank {node_rank} is outside the rank table's servers"
                f" 0..{table.num_nodes - 1} ({table.source})."
            )
        master_addr = args.master_addr or table.servers[0].server_id
    return RunConfig(
        program=program, worker_num=worker_num + server_num,
        local_worker_num=local_worker_num + local_servers, server_num=server_num,
        local_server_num=local_servers,
        master_addr=master_addr, master_port=args.master_port, node_rank=node_rank,
        log_dir=args.log_dir, tail_ranks=_tail_ranks(args.tail_worker_log, worker_num),
        join=args.join, cluster_timeout=args.cluster_timeout, max_restarts=args.max_restarts,
        bind_core=args.bind_core, rank_table=args.rank_table, run_id=args.run_id,
        checkpoint_dir=args.checkpoint_dir, hang_timeout=args.hang_timeout, min_nodes=min_nodes,
    )  # fmt: skip


def _server_num(
    args: argparse.Namespace,
    worker_num: int,
    local_worker_num: int,
    table: RankTable | None,
    max_nodes: int | None,
    min_nodes: int | None,
) -> tuple[int, int]:
    """``--server-num``: the job's parameter servers, and each node's share of them (the last
    local ranks of every node), beside the workers."""
    servers = args.server_num
    if servers == 0:
        return 0, 0
    if servers < 0:
        raise LaunchError(f"--server-num {servers} must be >= 0 (0: no parameter servers).")
    if table is not None:
        raise LaunchError(
            f"--server-num {servers} with --rank-table: a rank table maps every rank to a"
            " device, and parameter servers hold none. Start the job with torchrun, mpirun or"
            " srun and PLAIT_SERVER_NUM (the last ranks serve), or without the rank table."
        )
    if min_nodes is not None and min_nodes != max_nodes:
        raise LaunchError(
            f"--server-num {servers} with an elastic --nnodes {min_nodes}:{max_nodes}: a node"
            " leaving would take its servers' rows with it. Give a fixed --nnodes N."
        )
    nodes = max(worker_num // max(local_worker_num, 1), 1)
    if servers % nodes:
        raise LaunchError(
            f"--server-num {servers} over {nodes} nodes: every node runs the same processes,"
            f" so each starts servers / nodes of them; give a multiple of {nodes} (e.g."
            f" --server-num {nodes * max(servers // nodes, 1)})."
        )
    return servers, servers // nodes


def _nnodes(value: str | None) -> tuple[int | None, int | None]:
    """`--nnodes N` or `MIN:MAX` as (min, max); (None, None) when not given."""
    if value is None:
        return None, None
    parts = value.split(":")
    try:
        numbers = [int(part) for part in parts]
    except ValueError:
        numbers = []
    if len(numbers) not in (1, 2) or min(numbers, default=0) < 1:
        raise LaunchError(
            f"--nnodes {value!r} is not N or MIN:MAX with positive integers (e.g. 2, or 1:4 for"
            " an elastic job of 1 to 4 nodes)."
        )
    return numbers[0], numbers[-1]


def _program(args: argparse.Namespace) -> tuple[str, ...]:
    """The workers' program: the script (or ``-m`` module) and its arguments, or plait's
    cluster check under ``--diagnose``."""
    if args.diagnose:
        if args.program is not None or args.module:
            given = " ".join(filter(None, ["-m" if args.module else "", args.program or ""]))
            raise LaunchError(
                f"--diagnose runs plait's cluster check (plait.launch.doctor) instead of a "
                f"program, and {given!r} was given too: drop one of the two."
            )
        return ("-m", "plait.launch.doctor", *args.program_args)
    if args.program is None:
        return ()  # RunConfig refuses it by name
    return (("-m",) if args.module else ()) + (args.program, *args.program_args)


def _worker_counts(
    args: argparse.Namespace, table: RankTable | None, max_nodes: int | None
) -> tuple[int, int]:
    total, local = args.worker_num, args.local_worker_num
    if max_nodes is not None and table is None:
        if local is None:
            raise LaunchError(
                f"--nnodes {args.nnodes} needs --local-worker-num: the workers each node starts."
            )
        if total is not None and total != max_nodes * local:
            raise LaunchError(
                f"--worker-num {total} does not match --nnodes {args.nnodes} with"
                f" --local-worker-num {local} ({max_nodes} x {local} = {max_nodes * local} at"
                " most). Drop --worker-num."
            )
        return max_nodes * local, local
    if table is None:
        return total or local or 1, local or total or 1
    if total is not None and total != table.world_size:
        raise LaunchError(
            f"--worker-num {total} does not match rank table {table.source}, which lists"
            f" {table.world_size} ranks. Drop --worker-num or fix the table."
        )
    if local is not None and local != table.local_world_size:
        raise LaunchError(
            f"--local-worker-num {local} does not match rank table {table.source}, which lists"
            f" {table.local_world_size} devices per server. Drop --local-worker-num."
        )
    return table.world_size, table.local_world_size


def _tail_ranks(value: str, worker_num: int) -> tuple[int, ...]:
    text = value.strip().lower()
    if text in ("all", "-1"):
        return tuple(range(worker_num))
    if text in ("none", ""):
        return ()
    try:
        return tuple(sorted({int(part) for part in text.split(",")}))
    except ValueError as e:
        raise LaunchError(
            f"--tail-worker-log {value!r} is not a list of ranks. Use e.g. '0', '0,3', 'all'"
            " or 'none'."
        ) from e


def emit_options_from_args(args: argparse.Namespace) -> EmitOptions:
    """`EmitOptions` from the `--emit` flags."""
    return EmitOptions(
        target=EmitTarget(args.emit), job_name=args.job_name, image=args.image,
        k8s_api=KubernetesApi(args.k8s_api),
    )  # fmt: skip


def with_log_dir(config: RunConfig) -> RunConfig:
    """`config` with a log directory: the given one, or a new temporary directory."""
    if config.log_dir is not None:
        try:
            os.makedirs(config.log_dir, exist_ok=True)
        except OSError as e:
            raise LaunchError(
                f"--log-dir {config.log_dir!r} cannot be created ({e.strerror}). Pass a writable"
                " directory."
            ) from e
        return config
    return dataclasses.replace(config, log_dir=tempfile.mkdtemp(prefix="plait-run-"))
