"""Test helpers: N simulated ranks in one process, and real multi-process gloo workers.

``simulate(world_size=N)`` runs ``parallelize`` and ``Job.step`` unchanged with every rank's
data held in one process (DTensor's ``LocalTensorMode`` over the fake process group);
collectives compute exact results, so a simulated step equals a real one. It is not a
performance model: everything runs serially on one CPU.
"""

from plait.errors import WorkerFailed
from plait.launch.local import run_workers
from plait.testing.simulate import simulate

__all__ = ["WorkerFailed", "run_workers", "simulate"]
