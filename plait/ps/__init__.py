"""Parameter-server training (``ParallelConfig(mode="parameter_server")``).

Embedding tables too large for one device live on server ranks, split by row, each server
applying a sparse optimizer to the rows a step touched; workers pull the rows their batch
names and push those rows' gradients, while the dense rest of the model trains data parallel
over the workers (MindSpore's hybrid of parameter server and all-reduce). docs/parameter_server.md
tells the whole story.

- :mod:`plait.ps.table`: a table's spec, its split over servers, the rows made on servers;
- :mod:`plait.ps.server`: the loop a server rank runs (from ``plait.init()``);
- :mod:`plait.ps.worker`: the server-backed table modules and the worker's pulls and pushes;
- :mod:`plait.comm.ps`: the transport (a gloo group of workers and servers).
"""

from plait.annotate.marks import on_server
from plait.config import SparseOptimizer
from plait.ps.table import TableSpec, initial_table, sparse_optimizer

__all__ = ["SparseOptimizer", "TableSpec", "initial_table", "on_server", "sparse_optimizer"]
