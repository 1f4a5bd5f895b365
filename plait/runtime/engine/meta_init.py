"""Meta init: a model built under ``with torch.device("meta"):`` laid out without its values.

Such a model has shapes and no memory. ``plait.parallelize`` never makes it whole: placement
gives each rank uninitialised pieces of its own (:mod:`plait.runtime.engine.placement`), ranks that
hold the whole model (stand-alone, plain data parallel) get an uninitialised copy on their
device (:func:`materialize_meta`), and the model is recorded as uninitialised until
``job.load_pretrained`` (:mod:`plait.runtime.engine.pretrained`) or ``job.load`` fills every piece;
:func:`require_initialised` refuses to train it before.

Two things a file cannot give and this module checks or works around:

* non-persistent buffers (a causal mask, rotary tables) are not in ``state_dict``, so they
  must be real before parallelize: :func:`check_meta_buffers` names any left on meta;
* a plan job exports the model (on fake tensors) to plan and run it. Export of a model whose
  parameters are on meta but whose buffers are real mixes devices in one op, and export of
  an all-meta model bakes ``device="meta"`` into factory calls (``torch.arange(t,
  device=ids.device)``). :func:`meta_view` shows export an all-meta model and
  :func:`retarget_devices` then points the program's device arguments at the real device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from plait._compat import simulation_suspended
from plait.errors import CheckpointError
from plait.graph.export import ExecutableCapture, LossFn, capture_program, in_mode

__all__ = [
    "autocast_regions_on",
    "capture_on_device",
    "check_meta_buffers",
    "has_meta_tensors",
    "is_uninitialised",
    "mark_initialised",
    "mark_uninitialised",
    "materialize_meta",
    "meta_view",
    "move_to_device",
    "require_initialised",
    "retarget_devices",
    "under_paths",
]

_UNINITIALISED = "_plait_uninitialised"
"""Attribute set on a model whose parameters were created empty from the meta device and not
loaded since (on the model, as plait's annotations are: no process-wide registry)."""

_META = torch.device("meta")


def has_meta_tensors(model: nn.Module) -> bool:
    """True when any parameter or buffer of ``model`` is on the meta device."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def check_meta_buffers(model: nn.Module) -> None:
    """Refuse non-persistent buffers on the meta device: ``state_dict`` leaves them out, so no
    pretrained file or checkpoint can fill them and they would stay garbage."""
    missing = [
        f"{path}.{name}" if path else name
        for path, module in model.named_modules()
        for name, b in module._buffers.items()
        if b is not None and b.is_meta and name in module._non_persistent_buffers_set
    ]
    if missing:
        shown = ", ".join(repr(n) for n in missing[:4])
        more = f" (and {len(missing) - 4} more)" if len(missing) > 4 else ""
        raise CheckpointError(
            f"non-persistent buffer {shown}{more} is on the meta device: it is not part of "
            "state_dict, so no pretrained file or checkpoint can fill it. After building the "
            "model under torch.device('meta'), give it its value on a real device (e.g. "
            "module.register_buffer(name, value, persistent=False)), then parallelize"
        )


def mark_uninitialised(model: nn.Module) -> None:
    """``model``'s parameters were just created empty (from the meta device)."""
    object.__setattr__(model, _UNINITIALISED, True)


def mark_initialised(model: nn.Module) -> None:
    """Every parameter and buffer of ``model`` now holds loaded values."""
    if getattr(model, _UNINITIALISED, False):
        object.__delattr__(model, _UNINITIALISED)


def is_uninitialised(model: nn.Module) -> bool:
    """True while ``model``'s pieces are the empty ones created from the meta device."""
    return bool(getattr(model, _UNINITIALISED, False))


def require_initialised(model: nn.Module, what: str = "job.step") -> None:
    """Refuse ``what`` on a model whose pieces were never filled: it would train on whatever
    memory ``torch.empty`` returned, different on every rank."""
    if is_uninitialised(model):
        raise CheckpointError(
            f"{what}: the model was built on the meta device, so its parameters are "
            "uninitialised; call job.load_pretrained(path) (a .safetensors file or a Hugging "
            "Face model directory) or job.load(checkpoint) first"
        )


def materialize_meta(
    model: nn.Module, device: torch.device | str, host_modules: Sequence[str] = ()
) -> bool:
    """Meta parameters and persistent buffers -> uninitialised tensors on ``device`` (in place;
    tied parameters stay one tensor, which ``Module.to_empty`` does not keep); the model is
    then marked uninitialised. For jobs where each rank holds the whole model. The modules at
    ``host_modules`` (paths) and inside them get theirs in host memory instead: a table kept
    on the host is never allocated on the device. Returns whether anything was on the meta
    device."""
    check_meta_buffers(model)
    if not has_meta_tensors(model):
        return False
    done: dict[int, nn.Parameter] = {}
    # Plain tensors even in a simulated world: the caller makes per-rank copies if it needs.
    with simulation_suspended():
        for path, module in model.named_modules():
            where = "cpu" if under_paths(path, host_modules) else device
            for name, p in list(module._parameters.items()):
                if p is None or not p.is_meta:
                    continue
                if id(p) not in done:
                    value = torch.empty(p.shape, dtype=p.dtype, device=where)
                    done[id(p)] = nn.Parameter(value, p.requires_grad)
                module._parameters[name] = done[id(p)]
            for name, b in list(module._buffers.items()):
                if b is not None and b.is_meta:
                    module._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=where)
    mark_uninitialised(model)
    return True


def under_paths(path: str, paths: Sequence[str]) -> bool:
    """Whether module ``path`` is one of ``paths`` or inside one."""
    return any(path == p or path.startswith(p + ".") for p in paths)


def move_to_device(model: nn.Module, device: torch.device, keep: Sequence[str] = ()) -> None:
    """``model.to(device)``, except the modules at the paths ``keep`` and inside them, which
    stay where they are (host modules: never copied to the device and back)."""
    if not keep:
        model.to(device)
        return
    for path, module in model.named_modules():
        if not under_paths(path, keep):
            module._apply(lambda t: t.to(device), recurse=False)


@contextlib.contextmanager
def meta_view(model: nn.Module) -> Iterator[None]:
    """Inside the block every parameter and buffer of a model with meta tensors is on meta;
    the real ones are put back after. A no-op for models without meta tensors.

    For export: it reads shapes only, and fake meta and real-device tensors do not mix in one
    op (a meta weight and a real causal mask). Tied parameters keep one stand-in.
    """
    if not has_meta_tensors(model):
        yield
        return
    saved: list[tuple[nn.Module, str, bool, torch.Tensor]] = []
    stand_ins: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and not p.is_meta:
                saved.append((module, name, True, p))
        for name, b in module._buffers.items():
            if b is not None and not b.is_meta:
                saved.append((module, name, False, b))
    for module, name, is_param, t in saved:
        if is_param:
            if id(t) not in stand_ins:
                stand_ins[id(t)] = nn.Parameter(t.detach().to(_META), t.requires_grad)
            module._parameters[name] = stand_ins[id(t)]
        else:
            module._buffers[name] = t.detach().to(_META)
    try:
        yield
    finally:
        for module, name, is_param, t in saved:
            table = module._parameters if is_param else module._buffers
            table[name] = t  # type: ignore[assignment]


def retarget_devices(program: torch.export.ExportedProgram, device: torch.device) -> int:
    """Point every ``device="meta"`` argument of ``program``'s graph (factory calls and
    ``.to(...)`` that read the device of a meta input at export) at ``device``, in place.
    Returns how many arguments changed."""
    changed = 0

    def swap(value: object) -> object:
        nonlocal changed
        if isinstance(value, torch.device) and value.type == "meta":
            changed += 1
            return device
        if isinstance(value, list | tuple):
            return type(value)(swap(v) for v in value)
        if isinstance(value, dict):
            return {k: swap(v) for k, v in value.items()}
        return value

    for gm in program.graph_module.modules():  # regions export kept as subgraphs too
        if not isinstance(gm, torch.fx.GraphModule):
            continue
        before = changed
        for node in gm.graph.nodes:
            if node.op == "call_function":
                node.args = swap(node.args)  # type: ignore[assignment]
                node.kwargs = swap(node.kwargs)  # type: ignore[assignment]
        if changed != before:
            gm.recompile()
    return changed


def capture_on_device(
    model: nn.Module,
    example_batch: Any,
    loss_fn: LossFn | None,
    *,
    training: bool,
    device: torch.device,
) -> ExecutableCapture:
    """The model's program for running on ``device``, in training or eval mode: exported as
    it is, or for a model with meta tensors, exported all on meta (:func:`meta_view`) with its
    device arguments pointed at ``device`` (:func:`retarget_devices`)."""
    with meta_view(model), in_mode(model, training=training):
        if has_meta_tensors(model):
            with autocast_regions_on(device.type):
                captured = capture_program(model, example_batch, loss_fn)
        else:
            captured = capture_program(model, example_batch, loss_fn)
    if has_meta_tensors(model):
        retarget_devices(captured.program, device)
    return captured


@contextlib.contextmanager
def autocast_regions_on(device_type: str) -> Iterator[None]:
    """Inside the block ``torch.autocast(device_type="meta", ...)`` means ``device_type``.

    A model exported on meta tensors opens its autocast regions on ``x.device.type``, which
    is "meta" there (Hugging Face Llama's rotary embedding: ``torch.autocast(device_type=...,
    enabled=False)``), and torch has no autocast for meta; the program runs on ``device_type``,
    so that is the region it means. torch.autocast's constructor is swapped for the block only.
    """
    original = torch.autocast.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("device_type") == "meta":
            kwargs["device_type"] = device_type
        elif args and args[0] == "meta":
            args = (device_type, *args[1:])
        original(self, *args, **kwargs)

    torch.autocast.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.autocast.__init__ = original  # type: ignore[method-assign]
