"""What runs around a pipeline stage's forward, in place: recompute under torch's checkpoint
(eager stages; compiled ones recompute as their graph's pass), autocast, and activation offload
by saved-tensor hooks that keep what backward reads in host memory (:class:`SavedOnHost`).
:func:`wrap_stages` applies what a config asks to this rank's stages."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.utils.checkpoint
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from plait._compat import tree_leaves, tree_map
from plait.comm.dtensor import dtensor_from_local, is_dtensor, local_piece
from plait.config import ParallelConfig
from plait.errors import ConfigError
from plait.runtime.engine.precision import autocast_for
from plait.runtime.pipeline.stage_program import StageProgram
from plait.runtime.program.remat import kept_by_selective

logger = logging.getLogger(__name__)

__all__ = [
    "SavedOnHost",
    "autocast_stage",
    "recompute_eagerly",
    "recompute_modules_in_stages",
    "recompute_stage",
    "selective_policy",
    "wrap_stages",
]


def wrap_stages(
    model: nn.Module,
    modules: list[nn.Module],
    config: ParallelConfig,
    device: torch.device,
    *,
    programs: Sequence[StageProgram] = (),
) -> SavedOnHost | None:
    """What runs around each stage's forward, in place: recompute (the stage's, then each
    named module's), autocast, and activation offload; returns the offload, if any.
    ``programs``: the stages' compiled programs (one a module, or none), which recompute in
    their own backward graphs (:func:`plait.runtime.pipeline.stage_program.recompute_in_backward`), not
    under torch's checkpoint, and offload what their autograd function saves (the hooks
    around the function's call, not around the trace)."""
    if config.recompute in ("full", "selective") and not programs:
        for m in modules:
            recompute_stage(m, config.recompute)
    recompute_modules_in_stages(model, modules, config, programs)
    if config.precision != "fp32":
        for m in modules:
            autocast_stage(m, config.precision, device.type)
    if config.offload != "activations":
        return None
    offload = SavedOnHost(device)
    if programs:
        for program in programs:
            program.saving = offload.saving
    else:
        for m in modules:
            offload.wrap(m)
    return offload


HOST = torch.device("cpu")

_View = tuple[tuple[int, ...], tuple[int, ...], int]
"""(size, stride, storage offset) of a view."""


@dataclass(frozen=True, slots=True)
class _OnHost:
    """A saved tensor waiting on the host: the host copy of the memory it views, and what
    brings it back."""

    copy: torch.Tensor
    device: torch.device
    view: _View | None
    """(size, stride, offset into ``copy``) of a view of the copied tensor; None: the copy
    is the saved tensor itself."""
    dtensor: tuple[Any, tuple[Any, ...], tuple[int, ...], tuple[int, ...]] | None
    """(device mesh, placements, shape, stride) of a DTensor (tensor parallel in the stage),
    whose local piece moved."""


class SavedOnHost:
    """``offload="activations"`` in pipeline stages: each tensor a stage's forward (and the
    last stage's loss) saves for backward is copied to host memory when it is saved and back
    to the device when backward reads it (saved-tensor hooks, as torch's ``save_on_cpu``), so
    between a micro-batch's forward and its backward the device holds none of it. The stages
    run the user's modules under torch's pipelining, not the compiled program, so the
    program's pass (:mod:`plait.runtime.program.offload`) cannot apply; the plan's rule is kept:

    - values under ``min_bytes`` (1 MiB a micro-batch, the plan's threshold) stay;
    - parameters, buffers and views of them stay (held anyway; FSDP2 frees and gathers its
      own), and so do the forward's inputs (torch's stage holds them for the input gradient);
    - one value is one copy, however many ops save it or reshaped views of it (the plan
      counts one buffer per value): a view as large as its contiguous base is brought back
      as that view of the base's copy.

    Copies are pinned and asynchronous on CUDA (ordered on the compute stream). On a CPU
    device the host is the device: the copies still run (the same numerics, and the device
    value dies after forward), but save nothing.
    """

    def __init__(
        self, device: torch.device, *, min_bytes: int = 1 << 20, host: torch.device = HOST
    ) -> None:
        self.device, self.host, self.min_bytes = device, host, min_bytes
        self._pinned = device.type == "cuda" and host.type == "cpu"
        self.moved = 0
        """Values copied to the host since the counts were last reset (each training step)."""
        self.moved_bytes = 0

    def wrap(self, module: nn.Module) -> None:
        """Run ``module``'s forward under :meth:`saving` (in place, as the other stage
        wrappers); evaluation and prediction, which keep nothing, run as they are."""
        inner = module.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return inner(*args, **kwargs)
            with self.saving((args, kwargs), module):
                return inner(*args, **kwargs)

        module.forward = forward  # type: ignore[method-assign]

    def saving(
        self, held: Any, module: nn.Module | None = None
    ) -> torch.autograd.graph.saved_tensors_hooks:
        """Saved-tensor hooks for one forward: ``held``'s tensors (its inputs) and
        ``module``'s parameters and buffers, as they are when it starts (FSDP2's gathered
        ones), stay where they are."""
        tensors = [t for t in tree_leaves(held) if isinstance(t, torch.Tensor)]
        if module is not None:
            tensors += [*module.parameters(), *module.buffers()]
        with torch.no_grad():
            kept = {_storage_of(t) for t in tensors}
        copies: Any = WeakIdKeyDictionary()  # each copied value's host copy, by the value

        def pack(t: torch.Tensor) -> Any:
            with torch.no_grad():
                local = local_piece(t)
                nbytes = local.numel() * local.element_size()
                if nbytes < self.min_bytes or _storage_of(local) in kept:
                    return t
                value, view = _value_of(local)
                copy = copies.get(value)
                if copy is None:
                    copy = copies[value] = self._to_host(value)
                    self.moved += 1
                    self.moved_bytes += nbytes
                dtensor = None
                if is_dtensor(t):
                    dtensor = (t.device_mesh, tuple(t.placements), tuple(t.shape), t.stride())
                return _OnHost(copy, local.device, view, dtensor)

        def unpack(packed: Any) -> torch.Tensor:
            return self._back(packed) if isinstance(packed, _OnHost) else packed

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def _to_host(self, value: torch.Tensor) -> torch.Tensor:
        copy = torch.empty_like(value, device=self.host, pin_memory=self._pinned)
        return copy.copy_(value, non_blocking=self._pinned)

    def _back(self, packed: _OnHost) -> torch.Tensor:
        value = packed.copy.to(packed.device, non_blocking=self._pinned)
        if packed.view is not None:
            size, stride, offset = packed.view
            value = value.as_strided(size, stride, offset)
        if packed.dtensor is None:
            return value
        mesh, placements, shape, stride = packed.dtensor
        return dtensor_from_local(value, mesh, placements, shape, stride)


def _value_of(t: torch.Tensor) -> tuple[torch.Tensor, _View | None]:
    """The tensor to copy for saved tensor ``t`` and where ``t`` lies in it: a reshaped view
    (as large as its base, a contiguous one, so the copy keeps its strides) is its base, at
    its size, stride and offset; anything else is itself (None)."""
    base = t._base
    if base is None or base.numel() != t.numel() or not base.is_contiguous():
        return t, None
    offset = int(t.storage_offset() - base.storage_offset())
    return base, (tuple(t.size()), tuple(t.stride()), offset)


def _storage_of(t: torch.Tensor) -> int:
    """The address of the memory ``t`` (its local piece, for a DTensor) is a view of."""
    return int(local_piece(t).untyped_storage().data_ptr())


def autocast_stage(module: nn.Module, precision: str, device_type: str) -> None:
    """Mixed precision for a stage (``precision="bf16"`` or ``"fp16"``): its forward runs under autocast, as
    one device's whole forward would, and its floating outputs leave in fp32, the dtype the
    stages were traced with and the pipeline's buffers hold (a bf16 value widened to fp32 is
    exact, and the next op's autocast narrows it again where one device's would). Parameters,
    gradients and optimizer states stay fp32. Wraps ``forward`` in place."""
    inner = module.forward

    def widen(x: Any) -> Any:
        low = isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float32
        return x.float() if low else x

    def forward(*args: Any, **kwargs: Any) -> Any:
        with autocast_for(precision, device_type):
            out = inner(*args, **kwargs)
        return tree_map(widen, out)

    module.forward = forward  # type: ignore[method-assign]


def recompute_stage(module: nn.Module, mode: str = "full") -> None:
    """Recompute for a stage (torch's non-reentrant activation checkpoint around its forward,
    dropout masks replayed from the saved RNG state). ``"full"``: the forward keeps only its
    inputs for backward and runs again there, so a stage holds one micro-batch's activations
    at a time instead of one per micro-batch in flight. ``"selective"`` (Megatron's selective
    recompute, torch's selective checkpoint): the results of matrix products, convolutions,
    attention kernels and embedding lookups are kept, the cheap rest (pointwise ops,
    activations, norms, softmax) recomputed; the same rule as the program's pass
    (:func:`plait.runtime.program.remat.kept_by_selective`). Wraps ``forward`` in place."""
    module.forward = checkpointed(module.forward, mode)  # type: ignore[method-assign]


def checkpointed(inner: Callable[..., Any], mode: str) -> Callable[..., Any]:
    """``inner`` under torch's checkpoint (:func:`recompute_stage`'s rule for ``mode``)."""
    context: dict[str, Any] = {}
    if mode == "selective":
        context["context_fn"] = functools.partial(
            torch.utils.checkpoint.create_selective_checkpoint_contexts, selective_policy
        )

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation, prediction: nothing to keep
            return inner(*args, **kwargs)
        return torch.utils.checkpoint.checkpoint(
            inner, *args, use_reentrant=False, **context, **kwargs
        )

    return forward


def recompute_eagerly(
    program: StageProgram, module: nn.Module, mode: str, held: Sequence[tuple[str, str]]
) -> None:
    """A compiled stage whose trace was refused (it runs eagerly from then on) still
    recomputes as asked: its eager forward under torch's checkpoint (``mode`` full or
    selective) and each of its ``held`` modules' too, instead of silently keeping every
    activation."""
    if mode in ("full", "selective"):
        program.eager = checkpointed(program.eager, mode)
    for path, kind in held:
        recompute_stage(module.get_submodule(path), kind)
    if mode in ("full", "selective") or held:
        logger.warning(
            "pipeline: the stage's recompute (%s%s) runs as torch's checkpoint on its eager "
            "forward",
            mode,
            f", modules {[p for p, _ in held]}" if held else "",
        )


def recompute_modules_in_stages(
    model: nn.Module,
    modules: list[nn.Module],
    config: ParallelConfig,
    programs: Sequence[StageProgram] = (),
) -> None:
    """Per-module recompute (``recompute_modules``, ``plait.recompute(module)``): each named
    module, in whichever of this rank's stages holds it, recomputes its forward in backward
    (``"full"``) or its cheap ops (``"selective"``). The stages keep the model's modules (a
    stage calls them), so a path names the same module in its stage. Eager stages wrap the
    module in torch's checkpoint; compiled ones (``programs``, one a stage) recompute it as
    a region of their graph's recompute pass."""
    paths = cast("tuple[tuple[str, str], ...]", config.recompute_modules)
    for path, _ in paths:
        try:
            model.get_submodule(path)
        except AttributeError:
            raise ConfigError(
                f"ParallelConfig.recompute_modules names {path!r}, which is not a module of "
                f"{type(model).__name__}; give module paths as model.named_modules() lists them"
            ) from None
    for k, m in enumerate(modules):
        held = [(path, mode) for path, mode in paths if _has_submodule(m, path)]
        if programs:
            programs[k].recompute_modules = tuple(held)
            programs[k].on_eager = functools.partial(
                recompute_eagerly, programs[k], m, config.recompute, tuple(held)
            )
            continue
        for path, mode in held:
            recompute_stage(m.get_submodule(path), mode)


def _has_submodule(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False  # in another rank's stage
    return True


def selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """Selective recompute's choice per op, for torch's selective checkpoint."""
    policy = torch.utils.checkpoint.CheckpointPolicy
    schema = getattr(op, "_schema", None)
    keep = schema is not None and kept_by_selective(schema.name)
    return policy.MUST_SAVE if keep else policy.PREFER_RECOMPUTE
