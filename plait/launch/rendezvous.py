"""The `plait` rendezvous backend: torch's c10d rendezvous, plus node ranks and clear timeouts.

Nodes meet through torch elastic's c10d dynamic rendezvous (`create_backend` + `create_handler`,
the same objects `torchrun --rdzv-backend c10d` uses). This module wraps the resulting handler
to add two things torch leaves out:

1. **Fixed node ranks.** c10d numbers nodes by sorting their descriptors (host, pid), so
   `--node-rank` would be ignored. When every node passes `--node-rank`, each one publishes its
   rank in the round's store after the rendezvous and takes it as its group rank; a duplicate
   or missing rank fails the launch on every node, naming the ranks seen.
   -> `NodeRankedHandler._reorder()`
2. **Timeouts that say who is missing.** Each node adds itself to an arrival counter before
   joining; when the join times out the error says how many of the expected nodes arrived and,
   with node ranks, which ones did not. A node that cannot reach the rendezvous host says so.
   -> `NodeRankedHandler.next_rendezvous()`, `create_plait_handler()`
3. **One job shape.** The first node to arrive records its `--worker-num`/`--local-worker-num`
   in the store; a node that passed others is refused at once, naming both, and closes the
   rendezvous so the nodes already waiting stop with the same message instead of timing out.
   -> `NodeRankedHandler._check_shape()`

It is not a new rendezvous protocol: membership, rounds, heartbeats and restarts stay c10d's.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from torch.distributed import Store
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

from plait.errors import LaunchError

__all__ = [
    "BACKEND_NAME",
    "NodeRankedHandler",
    "StoreKeeper",
    "create_plait_handler",
    "register_backend",
]

logger = logging.getLogger(__name__)

BACKEND_NAME = "plait"
"""Name under which the backend is registered with torch elastic."""


class StoreKeeper:
    """Keeps the rendezvous store for the launcher once torch's agent is done with it.

    Passed in the rendezvous configs (`plait_store_keeper`); `create_plait_handler` puts the
    store here. On node 0 the store's server lives as long as this reference, so the nodes can
    still exchange their failure reports (`plait.launch.node_reports`) after the workers end.
    """

    def __init__(self) -> None:
        self.store: Store | None = None

    def __repr__(self) -> str:
        return f"StoreKeeper(store={'set' if self.store is not None else None})"


class NodeRankedHandler(RendezvousHandler):
    """A c10d `DynamicRendezvousHandler` that honours node ranks and explains timeouts."""

    def __init__(
        self, inner: RendezvousHandler, store: Store, params: RendezvousParameters
    ) -> None:
        self._inner = inner
        self._store = store
        self._node_rank = params.get_as_int("plait_node_rank")
        self._expected = params.max_nodes
        self._timeout = params.get_as_int("join_timeout", 600)
        self._endpoint = params.endpoint
        self._attempt = 0
        shape = params.get("plait_shape")
        self._shape: str | None = shape if isinstance(shape, str) else None

    def get_backend(self) -> str:
        return BACKEND_NAME

    @property
    def use_agent_store(self) -> bool:
        return self._inner.use_agent_store

    def next_rendezvous(self) -> RendezvousInfo:
        key = f"plait.arrived.{self.get_run_id()}.{self._attempt}"
        self._attempt += 1
        self._store.add(key, 1)
        if self._node_rank is not None:
            self._store.set(f"{key}.node{self._node_rank}", "1")
        self._check_shape()
        try:
            info = self._inner.next_rendezvous()
        except RendezvousTimeoutError as e:
            raise LaunchError(self._timeout_message(key)) from e
        except RendezvousClosedError as e:
            refused = self._refused_key()
            if self._store.check([refused]):
                raise LaunchError(self._store.get(refused).decode()) from e
            raise
        _republish_bootstrap(info)
        if self._node_rank is None:
            return info
        return self._reorder(info, self._node_rank)

    def _refused_key(self) -> str:
        return f"plait.refused.{self.get_run_id()}"

    def _describe(self, node_rank: int | None, shape: str) -> str:
        return f"{'a node' if node_rank is None else f'node {node_rank}'} passed {shape}"

    def _check_shape(self) -> None:
        """Refuse to join a job whose first node passed other worker counts (see 3. above)."""
        if self._shape is None:
            return
        rank = -1 if self._node_rank is None else self._node_rank
        # compare_set with expected "" sets the value only where none is stored yet and returns
        # what is stored: the first node's shape, or this one's when it is the first
        key = f"plait.shape.{self.get_run_id()}"
        first = self._store.compare_set(key, "", f"{rank}|{self._shape}").decode()
        first_rank_text, _, first_shape = first.partition("|")
        if first_shape == self._shape:
            return
        first_rank = None if int(first_rank_text) < 0 else int(first_rank_text)
        message = (
            f"Nodes of one job disagree at rendezvous {self._endpoint}:"
            f" {self._describe(first_rank, first_shape)}, but"
            f" {self._describe(self._node_rank, self._shape)}. Every node must pass the same"
            " --worker-num (the whole job's workers), --local-worker-num and --nnodes; restart"
            " the job with the same flags on every node."
        )
        self._store.set(self._refused_key(), message)
        self._inner.set_closed()  # the nodes already waiting stop with this message
        raise LaunchError(message)

    def _timeout_message(self, key: str) -> str:
        arrived = self._store.add(key, 0)
        msg = (
            f"Rendezvous at {self._endpoint} timed out after {self._timeout} s: {arrived} of"
            f" {self._expected} nodes arrived."
        )
        if self._node_rank is not None:
            missing = [
                r for r in range(self._expected) if not self._store.check([f"{key}.node{r}"])
            ]
            msg += f" Node ranks never seen: {missing}."
        return msg + (
            " Start `plait run` on every node with the same --master-addr/--master-port and"
            " --worker-num, or raise --cluster-timeout."
        )

    def _reorder(self, info: RendezvousInfo, node_rank: int) -> RendezvousInfo:
        store = info.store
        store.set(f"plait.node_rank.{info.rank}", str(node_rank))
        keys = [f"plait.node_rank.{r}" for r in range(info.world_size)]
        seen = sorted(int(v) for v in store.multi_get(keys))
        if seen != list(range(info.world_size)):
            raise LaunchError(
                f"The {info.world_size} nodes at rendezvous {self._endpoint} passed --node-rank"
                f" values {seen}; they must be 0..{info.world_size - 1}, each once. Give each"
                " node its own --node-rank (or none at all, to number nodes automatically)."
            )
        # torch's RendezvousInfo reads back the store info it was given as Optional but
        # annotates the argument as required: pass the same value on
        return RendezvousInfo(
            store,
            node_rank,
            info.world_size,
            info.bootstrap_store_info,  # type: ignore[arg-type]
        )

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return self._inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        return self._inner.shutdown()


def _republish_bootstrap(info: RendezvousInfo) -> None:
    """Publish the workers' store address in this round's store, on the round's rank 0.

    torch builds a handler's bootstrap store info once, at its first round: rank 0 then writes
    MASTER_ADDR/MASTER_PORT under that round's prefix and the other nodes read them there. A
    node that joins in a later round (an elastic scale-out, a node restarted by hand) builds
    its info then, and waits for keys under the new round's prefix that rank 0, keeping its
    old info, never writes: both nodes wait forever (torch 2.13). Rank 0 writes them each round.
    """
    boot = info.bootstrap_store_info
    if info.rank != 0 or boot is None:
        return
    info.store.set(RendezvousStoreInfo.MASTER_ADDR_KEY, boot.master_addr)
    info.store.set(RendezvousStoreInfo.MASTER_PORT_KEY, str(boot.master_port))


def create_plait_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Build the c10d backend and handler for `params` and wrap them (registry callback)."""
    timeout = params.get_as_int("read_timeout", 60) or 60
    try:
        backend, store = create_backend(params)
    except (RendezvousConnectionError, RuntimeError, TimeoutError) as e:
        reason = str(e).rstrip(".")
        raise LaunchError(
            f"Could not reach the rendezvous host {params.endpoint} within {timeout} s ({reason})."
            " Start node 0 (`--node-rank 0`, the host named by --master-addr) first, and check"
            " that --master-addr/--master-port are reachable from this node."
        ) from e
    # read_timeout bounded the wait for the host; later store operations are quick unless a
    # peer is gone, so give them at least a minute.
    store.set_timeout(timedelta(seconds=max(timeout, 60)))
    keeper = params.get("plait_store_keeper")
    if isinstance(keeper, StoreKeeper):
        keeper.store = store
    return NodeRankedHandler(create_handler(store, backend, params), store, params)


def register_backend() -> None:
    """Register the `plait` backend with torch elastic (idempotent: same creator each time)."""
    rendezvous_handler_registry.register(BACKEND_NAME, create_plait_handler)
