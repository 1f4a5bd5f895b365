"""Launching plait jobs: `plait run` and `plait.init()`.

MindSpore starts jobs with `msrun`, its dynamic cluster, mpirun or a rank table; plait covers
the same ground on torch's elastic launcher (c10d rendezvous):

- `init()` joins this process to the default process group and returns its `World`, from the
  environment of `plait run`, torchrun, OpenMPI, MPICH/PMI, Slurm or a rank table; alone, it
  makes a one-process world.
- `run_job(RunConfig(...))` is `plait run`: start one node's workers, supervise, report.
- `load_rank_table` reads and validates a MindSpore-format rank table.
- `emit` writes an sbatch script or Kubernetes manifest for the same job.

`launch` knows nothing of models (docs/architecture.md, "Layering"). User guide: docs/launch.md.
"""

from plait.errors import LaunchError
from plait.launch.config import RunConfig
from plait.launch.emit import EmitOptions, EmitTarget, KubernetesApi, emit
from plait.launch.environment import DEFAULT_MASTER_PORT, ProcessEnv, detect_environment
from plait.launch.rank_table import RankTable, load_rank_table, parse_rank_table
from plait.launch.world import World, init


def run_job(config: RunConfig):
    """Start this node's workers and supervise them; see `plait.launch.runner.run_job`."""
    from plait.launch.runner import run_job as _run_job

    return _run_job(config)


__all__ = [
    "DEFAULT_MASTER_PORT",
    "EmitOptions",
    "EmitTarget",
    "KubernetesApi",
    "LaunchError",
    "ProcessEnv",
    "RankTable",
    "RunConfig",
    "World",
    "detect_environment",
    "emit",
    "init",
    "load_rank_table",
    "parse_rank_table",
    "run_job",
]
