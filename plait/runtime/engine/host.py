"""Host and device heterogeneous training: chosen modules kept and computed on the host.

MindSpore's heterogeneous mode (``Primitive.set_device("CPU")``, the Wide&Deep recipe) puts
memory-heavy, compute-light operators, above all large embedding tables, on the host with
their optimizer, and joins the host and device parts with automatic copies. Here the unit is a
module (``ParallelConfig.host_modules``, ``plait.on_host(module)``):

* its parameters and buffers live in host memory, so do their gradients and the optimizer
  states the user's optimizer creates for them (torch's optimizers keep a state beside its
  parameter), and the update of those parameters runs on the CPU;
* a forward pre-hook copies the module's tensor inputs to the host, a forward hook copies its
  tensor outputs to the device; autograd carries the copies back in backward, so the module's
  backward runs on the host too;
* data parallelism averages the host gradients over the dp ranks on the host, in their own
  fused buckets (a bucket never mixes devices), over a gloo group when the world's collectives
  run on NCCL.

On a CPU-only machine the host is the device: the copies are no-ops, the numerics and the
placement are the same code. A parameter a host module shares with a module left on the device
(tied weights) is refused by name: one tensor cannot live in both memories.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from plait._compat import tree_map
from plait.annotate import host_marks
from plait.config import ParallelConfig
from plait.errors import ConfigError
from plait.runtime.engine.meta_init import under_paths

__all__ = [
    "HostPlacement",
    "host_module_paths",
    "place_on_host",
    "plan_host_placement",
]

HOST = torch.device("cpu")
_HOOKS_ATTR = "_plait_host_hooks"


@dataclass(frozen=True, slots=True)
class HostPlacement:
    """Which modules and parameters a job keeps on the host."""

    modules: tuple[str, ...]
    """Paths of the host modules (outermost only: a module inside another is covered by it)."""
    parameters: tuple[str, ...]
    """Names of the parameters on the host, as ``model.named_parameters()`` gives them."""
    parameter_bytes: int
    """Bytes of those parameters (their gradients are as large; Adam keeps twice as much)."""

    def describe(self) -> str:
        mib = self.parameter_bytes / 2**20
        return f"{', '.join(self.modules)} on the host ({len(self.parameters)} parameters, {mib:.1f} MiB)"


def host_module_paths(model: nn.Module, cfg: ParallelConfig) -> tuple[str, ...]:
    """The config's ``host_modules`` and the modules ``plait.on_host`` marked, checked against
    ``model``: each path names a sub-module, and only the outermost of nested ones is kept."""
    paths = sorted({*cfg.host_modules, *host_marks(model)})
    names = [n for n, _ in model.named_modules()]
    for path in paths:
        if path not in names:
            close = difflib.get_close_matches(path, names, n=3)
            hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
            raise ConfigError(
                f"ParallelConfig.host_modules names {path!r}, which is not a module of "
                f"{type(model).__name__}{hint}; give paths as model.named_modules() spells them"
            )
    return tuple(p for p in paths if not under_paths(p, [q for q in paths if q != p]))


def plan_host_placement(model: nn.Module, paths: Sequence[str]) -> HostPlacement:
    """The parameters ``paths`` keep on the host; a parameter also reached from a module left
    on the device (tied weights) is refused, naming both places."""
    host_ids: dict[int, str] = {}
    for path in paths:
        for name, p in model.get_submodule(path).named_parameters(remove_duplicate=False):
            host_ids.setdefault(id(p), f"{path}.{name}")
    for name, p in model.named_parameters(remove_duplicate=False):
        owner = name.rsplit(".", 1)[0] if "." in name else ""
        if id(p) in host_ids and not under_paths(owner, paths):
            raise ConfigError(
                f"host_modules: parameter {host_ids[id(p)]} is also {name}, used by module "
                f"{owner or type(model).__name__!r} which stays on the device (tied weights); "
                "one tensor cannot live in both memories: put that module on the host too, or "
                "untie the weights"
            )
    chosen = [(n, p) for n, p in model.named_parameters() if id(p) in host_ids]
    return HostPlacement(
        modules=tuple(paths),
        parameters=tuple(n for n, _ in chosen),
        parameter_bytes=sum(p.numel() * p.element_size() for _, p in chosen),
    )


def place_on_host(model: nn.Module, placement: HostPlacement, device: torch.device) -> None:
    """Move each host module to host memory and copy its inputs and outputs across (in place).

    Hooks a previous ``parallelize`` of the same module installed are removed first.
    """
    for path in placement.modules:
        module = model.get_submodule(path)
        for handle in getattr(module, _HOOKS_ATTR, ()):
            handle.remove()
        module.to(HOST)
        handles = (
            module.register_forward_pre_hook(_inputs_to_host, with_kwargs=True),
            module.register_forward_hook(_outputs_to(device)),
        )
        object.__setattr__(module, _HOOKS_ATTR, handles)


def _to_host(x: Any) -> Any:
    # device -> host copies are blocking: the CPU reads the result right away
    return x.to(HOST) if isinstance(x, torch.Tensor) and x.device != HOST else x


def _inputs_to_host(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return tree_map(_to_host, args), tree_map(_to_host, kwargs)


def _outputs_to(device: torch.device) -> Any:
    def to_device(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.device != device:
            # host -> device: ordered on the device's stream, safe to issue asynchronously
            return x.to(device, non_blocking=True)
        return x

    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        return tree_map(to_device, output)

    return hook
