"""Greedy generation on a job's layout: ``job.generate`` and a Hugging Face model's own
``job.model.generate``.

``job.generate(input_ids, max_new_tokens=n)`` decodes greedily: one forward of the prompt
(prefill), then one forward of the last token per step, the model's key/value cache carried
between them. The forward runs on the job's parameters as the plan lays them out (DTensors,
op by op, as hybrid mode's code runs), so the cache is laid out as the plan lays out
attention: a Hugging Face attention whose q/k/v projections are split over tp (Megatron,
``plait.annotate.megatron``, or a plan that splits them) writes keys and values split on the
head dim over tp, and the rows split over dp where the batch divides (each rank holds the
cache of its own rows and heads, nothing more). After each step the last position's logits
are gathered whole (one gather of ``[batch, vocab]``) and every rank takes the same argmax,
so the returned ids are whole and the same on every rank; they equal the model's own greedy
generation on one device (``model.generate(ids, do_sample=False, max_new_tokens=n)``).

What the forward needs on DTensors, and what this module adds for the length of a call only:

* a cache layer (``DynamicLayer``) starts from a plain empty tensor that a DTensor cannot be
  concatenated to: each layer's first keys and values are kept as the empty slice of the
  keys written (their own layout) instead;
* a pending sum (a row-parallel projection's, a vocabulary-split embedding's masked one) is
  summed as it leaves the module that made it (an all-reduce over tp, where Megatron puts
  it): left pending, DTensor's own choice of strategy for the next ops may carry it into a
  norm or into attention, which cannot take it;
* plain tensors made inside the forward (masks, positions) count as replicated.

Models with no key/value cache (plait's own, :mod:`plait.models`) generate by running the
whole sequence at each step (the same tokens; the cost of a forward of the sequence per
token). Jobs whose ranks hold the whole model (stand-alone, plain data parallel) run the
model as it is, the whole batch on every rank (no communication). Pipeline stages cannot
generate yet: refused by name (``plait.support``'s ``generate_pipeline``).

``job.model.generate(...)`` (Hugging Face's own, with its sampling, beam search and logits
processors) works on a job whose parameters are DTensors: :func:`install_model_generate`
(called by ``parallelize``) wraps the model's ``generate`` so that during it the token ids
enter the forward as DTensors (rows over dp where they divide, as above) and its outputs
leave whole, as plain tensors; the cache is laid out as above. With plain parameters (one
device, plain data parallel) the wrapped method is the model's own.

Not built: padded prompts (an attention mask with zeros) on DTensor parameters, refused by
name (:func:`refuse_padding`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
from collections.abc import Callable, Iterator, MutableMapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from plait import support
from plait._compat import tree_map
from plait.comm.dispatch import PlaitDispatchMode
from plait.comm.dtensor import (
    distribute,
    full_value,
    implicit_replication,
    is_dtensor,
    mesh_spec_of,
    sum_pending,
)
from plait.errors import ConfigError, NotBuiltError, ShardingError
from plait.graph import in_mode
from plait.layout import TensorLayout
from plait.runtime.engine.meta_init import require_initialised
from plait.runtime.engine.precision import autocast_for
from plait.runtime.engine.predict import Job as PredictingJob

if TYPE_CHECKING:
    from plait.mesh import MeshSpec

__all__ = ["GenerateRequest", "generate", "install_model_generate", "laid_out_forward"]


@dataclass(frozen=True)
class GenerateRequest:
    """What ``job.generate`` was asked, checked at construction."""

    input_ids: torch.Tensor
    max_new_tokens: int
    attention_mask: torch.Tensor | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        ids = self.input_ids
        if not isinstance(ids, torch.Tensor) or ids.ndim != 2 or ids.is_floating_point():
            given = (
                f"a {ids.ndim}-d {ids.dtype} tensor"
                if isinstance(ids, torch.Tensor)
                else type(ids).__name__
            )
            raise ShardingError(
                f"job.generate(input_ids=...): given {given}; input_ids must be the token ids "
                "of the whole batch, an integer tensor [batch, sequence], the same on every "
                "rank; pass ids[None] for one prompt"
            )
        if ids.shape[1] == 0:
            raise ShardingError(
                "job.generate: input_ids has no tokens (shape "
                f"{tuple(ids.shape)}); generation continues a prompt of at least one token"
            )
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise ConfigError(
                f"job.generate(max_new_tokens={self.max_new_tokens!r}): must be an int >= 1"
            )
        if self.max_new_tokens < 1:
            raise ConfigError(
                f"job.generate(max_new_tokens={self.max_new_tokens}): must be >= 1 (the number "
                "of tokens to add to each prompt)"
            )
        mask = self.attention_mask
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.shape != ids.shape):
            shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ShardingError(
                f"job.generate(attention_mask=...): given {shape}, input_ids {tuple(ids.shape)}; "
                "the mask is 1 for a prompt's tokens and 0 for padding, the shape of input_ids "
                "(pad on the left, as Hugging Face's generate expects)"
            )


class Job(PredictingJob, Protocol):
    """What generation reads of a :class:`plait.Job` beyond what prediction does (named
    here, not imported: the Job delegates ``generate`` to this module)."""

    @property
    def parameters_laid_out(self) -> bool: ...

    @property
    def engine(self) -> str: ...


def generate(
    job: Job,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    attention_mask: torch.Tensor | None = None,
    eos_token_id: int | Sequence[int] | None = None,
) -> torch.Tensor:
    """``job.generate``: see the module docstring."""
    refuse_on_stages(job, "generate")
    require_initialised(job.model, "job.generate")
    request = _request(job.model, input_ids, max_new_tokens, attention_mask, eos_token_id)
    laid_out = job.parameters_laid_out
    if laid_out and request.attention_mask is not None:
        refuse_padding(request.attention_mask, "job.generate")
    context = _laid_out_context(job.model) if laid_out else contextlib.nullcontext()
    lay: Callable[[torch.Tensor], torch.Tensor] = (
        functools.partial(_lay_rows, job) if laid_out else _same
    )
    precision = autocast_for(job.config.precision, job.device_type)
    with torch.no_grad(), in_mode(job.model, training=False), context, precision:
        return _greedy(job.model, request, lay)


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


def _request(
    model: nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    attention_mask: torch.Tensor | None,
    eos_token_id: int | Sequence[int] | None,
) -> GenerateRequest:
    """The request, with the model's own end-of-sequence and padding tokens (its generation
    config's, as Hugging Face's generate reads them) where the call gives none."""
    generation = getattr(model, "generation_config", None)
    if eos_token_id is None and generation is not None:
        eos_token_id = generation.eos_token_id
    eos = (
        ()
        if eos_token_id is None
        else (eos_token_id,)
        if isinstance(eos_token_id, int)
        else tuple(int(t) for t in eos_token_id)
    )
    pad = getattr(generation, "pad_token_id", None)
    if pad is None:
        pad = eos[0] if eos else 0
    return GenerateRequest(input_ids, max_new_tokens, attention_mask, eos, int(pad))


# --------------------------------------------------------------------------- the greedy loop


def _greedy(
    model: nn.Module, request: GenerateRequest, lay: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """Greedy decoding: the prompt once, then the last token per step with the cache (or the
    whole sequence per step for a model without one). Rows that reached an end-of-sequence
    token get the pad token after it; decoding stops when every row has ended."""
    ids = request.input_ids
    mask = torch.ones_like(ids) if request.attention_mask is None else request.attention_mask.long()
    step = _HuggingFaceStep(model) if _takes_cache(model) else _WholeSequenceStep(model)
    unfinished = torch.ones(ids.shape[0], dtype=torch.bool, device=ids.device)
    eos = torch.tensor(request.eos_token_ids, dtype=ids.dtype, device=ids.device)
    for _ in range(request.max_new_tokens):
        logits = step(ids, mask, lay)
        token = logits.argmax(-1).to(ids.dtype)
        token = torch.where(unfinished, token, torch.full_like(token, request.pad_token_id))
        ids = torch.cat([ids, token[:, None]], dim=1)
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        if len(request.eos_token_ids):
            unfinished &= ~torch.isin(token, eos)
            if not bool(unfinished.any()):
                break
    return ids


def _takes_cache(model: nn.Module) -> bool:
    """A Hugging Face causal LM: its forward takes a cache (``cache`` in transformers 5,
    ``past_key_values`` before) and it has a config to build one from."""
    return _cache_keyword(model) is not None and hasattr(model, "config")


def _cache_keyword(model: nn.Module) -> str | None:
    try:
        names = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None
    for name in ("cache", "past_key_values"):
        if name in names:
            return name
    return None


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """Hugging Face generate's positions from the attention mask: each prompt's tokens count
    from 0 after its left padding."""
    return (mask.cumsum(-1) - 1).clamp_min(0)


class _HuggingFaceStep:
    """One decoding step of a Hugging Face causal LM with its own cache, laid out as the
    model's attention writes it."""

    def __init__(self, model: nn.Module) -> None:
        from transformers import DynamicCache

        self.model = model
        self.cache = DynamicCache(config=model.config)  # type: ignore[arg-type]
        start_from_first_keys(self.cache)
        self.keyword = _cache_keyword(model)
        forward = inspect.signature(model.forward).parameters
        self.positions = "position_ids" in forward
        self.seen = 0

    def __call__(
        self, ids: torch.Tensor, mask: torch.Tensor, lay: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        new = ids[:, self.seen :]
        kwargs: dict[str, Any] = {
            "input_ids": lay(new.contiguous()),
            "use_cache": True,
            str(self.keyword): self.cache,
        }
        if not bool(mask.all()):  # one-device or plain data-parallel jobs only (checked)
            kwargs["attention_mask"] = mask
            if self.positions:
                kwargs["position_ids"] = _positions(mask)[:, self.seen :].contiguous()
        self.seen = ids.shape[1]
        out = self.model(**kwargs)
        return full_value(out.logits[:, -1, :]).float()


class _WholeSequenceStep:
    """One decoding step of a model without a cache: the whole sequence, the last logits."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(
        self, ids: torch.Tensor, mask: torch.Tensor, lay: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        if not bool(mask.all()):
            raise ShardingError(
                f"job.generate(attention_mask=...) on {type(self.model).__name__}, whose "
                "forward takes the token ids alone: it has no attention mask to read the "
                "padding from; pass prompts of one length without a mask"
            )
        out = self.model(lay(ids))
        logits = out if isinstance(out, torch.Tensor) else out[0]
        return full_value(logits[:, -1, :]).float()


def _lay_rows(job: Job, x: torch.Tensor) -> torch.Tensor:
    """``x`` (whole, the same on every rank) as a DTensor: dim 0 split over the data-parallel
    axis where the batch divides (each rank keeps its rows), else whole on every rank (a job
    whose parameters are laid out: it has a mesh)."""
    assert job.mesh is not None and job.device_mesh is not None
    return distribute(x, job.device_mesh, _rows_layout(job.mesh, job.config.dp_axis, x))


# -------------------------------------------------------------- the forward on DTensor pieces


def start_from_first_keys(cache: Any) -> None:
    """Each layer of a Hugging Face dynamic cache starts from the empty slice of the first
    keys and values written (their layout: DTensors split as the attention splits them)
    rather than from a plain empty tensor, which no DTensor can be concatenated to."""
    for layer in getattr(cache, "layers", ()):
        if getattr(layer, "is_initialized", True) or "_plait_first" in vars(layer):
            continue
        layer._plait_first = True
        layer.lazy_initialization = functools.partial(_first_keys, layer, layer.lazy_initialization)


def _first_keys(layer: Any, initialise: Callable[..., None], keys: Any, values: Any) -> None:
    initialise(keys, values)
    if is_dtensor(keys):
        layer.keys, layer.values = keys[..., :0, :], values[..., :0, :]


def _sum_pending_output(module: nn.Module, args: Any, out: Any) -> Any:
    """A pending sum summed as it leaves a leaf module (a row-parallel projection's, as
    Megatron reduces it; a vocabulary-split embedding's masked one): left pending, DTensor's
    own choice of strategy for the ops after it may carry it into attention, which cannot
    take it, or into a norm, which cannot read it."""
    if is_dtensor(out) and any(p.is_partial() for p in out.placements):
        return sum_pending(out)
    return out


@contextlib.contextmanager
def _laid_out_context(model: nn.Module) -> Iterator[None]:
    """The model's forward on its DTensor parameters, for the length of the block."""
    handles = [
        m.register_forward_hook(_sum_pending_output)
        for m in model.modules()
        if not any(True for _ in m.children())  # leaves: embeddings, projections, norms
    ]
    try:
        with implicit_replication(), PlaitDispatchMode():
            yield
    finally:
        for handle in handles:
            handle.remove()


def _rows_layout(spec: MeshSpec, dp_axis: str, x: torch.Tensor) -> TensorLayout:
    """Dim 0 split over ``dp_axis`` where it divides, else whole on every rank.

    Rows split over dp are what the plan's layouts were made for: with whole rows, DTensor's
    own choice of strategy for the projections may split them over dp itself and leave a
    pending sum over tp in front of attention, which it cannot run."""
    size = spec.axis_size(dp_axis) if dp_axis in spec.axis_names else 1
    dims: tuple[tuple[str, ...], ...] = ((),) * x.ndim
    if size > 1 and x.ndim and x.shape[0] % size == 0:
        dims = ((dp_axis,), *dims[1:])
    return TensorLayout(spec, dims)


@contextlib.contextmanager
def laid_out_forward(model: nn.Module, dp_axis: str = "dp") -> Iterator[None]:
    """Inside the block, ``model`` (its parameters DTensors) runs on plain token ids (their
    rows split over ``dp_axis`` where they divide) and returns plain, whole outputs; its cache
    starts as :func:`start_from_first_keys` says. What ``job.model.generate`` runs under."""
    mesh = next(p.device_mesh for p in model.parameters() if is_dtensor(p))
    spec = mesh_spec_of(mesh)

    def inputs(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> tuple[Any, Any]:
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and not is_dtensor(mask):
            refuse_padding(mask, f"{type(module).__name__}.generate on a job's layout")
        for name in ("cache", "past_key_values"):
            if kwargs.get(name) is not None:
                start_from_first_keys(kwargs[name])
        # no padding (refused above): the positions are 0, 1, ... after the cache's length,
        # which the model counts itself; generate's own copy would be one more plain input
        # to lay out, for the same values
        kwargs.pop("position_ids", None)
        ids = kwargs.get("input_ids")
        if isinstance(ids, torch.Tensor) and not is_dtensor(ids):
            kwargs["input_ids"] = distribute(ids, mesh, _rows_layout(spec, dp_axis, ids))
        return args, kwargs

    def outputs(module: nn.Module, args: Any, kwargs: Any, out: Any) -> Any:
        if isinstance(out, MutableMapping):  # a ModelOutput: its fields replaced in place
            for key, value in list(out.items()):
                if is_dtensor(value):
                    out[key] = full_value(value)
            return out
        return tree_map(lambda x: full_value(x) if is_dtensor(x) else x, out)

    handles = [
        model.register_forward_pre_hook(inputs, with_kwargs=True),
        model.register_forward_hook(outputs, with_kwargs=True),
    ]
    try:
        with _laid_out_context(model):
            yield
    finally:
        for handle in handles:
            handle.remove()


def install_model_generate(model: nn.Module, dp_axis: str = "dp") -> None:
    """Wrap a Hugging Face model's own ``generate`` (once) so that it runs on the job's
    DTensor parameters (:func:`laid_out_forward`); with plain parameters it is the model's
    own, untouched. The wrapper is a method bound to the model (a copy of the model gets
    its own, bound to the copy)."""
    if "generate" in vars(model) or not callable(getattr(type(model), "generate", None)):
        return
    model._plait_dp_axis = dp_axis  # type: ignore[assignment]
    model.generate = types.MethodType(_generate_on_layout, model)  # type: ignore[assignment]


def _generate_on_layout(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The model's class's ``generate``, under :func:`laid_out_forward` when its parameters
    are DTensors."""
    original = type(model).generate  # type: ignore[attr-defined]
    if not any(is_dtensor(p) for p in model.parameters()):
        return original(model, *args, **kwargs)
    with laid_out_forward(model, str(getattr(model, "_plait_dp_axis", "dp"))):
        return original(model, *args, **kwargs)


def refuse_padding(mask: torch.Tensor, call: str) -> None:
    """Padded prompts on DTensor parameters: not built (the padding mask the model builds
    beside split attention runs op by op through DTensor's generic path, minutes a token)."""
    if mask.ndim == 2 and not bool(mask.bool().all()):
        rows = [i for i in range(mask.shape[0]) if not bool(mask[i].bool().all())]
        raise NotBuiltError(
            f"{call}: an attention_mask with padding (rows {rows} hold zeros) is not built in "
            "this version of plait yet for a job whose parameters are laid out over a mesh; "
            "generate prompts of one length together (no padding: group prompts by length), "
            "or on one device"
        )


def refuse_on_stages(job: Job, call: str) -> None:
    """``job.<call>`` on pipeline stages: refused by ``plait.support``'s table."""
    if job.engine == "pipeline":
        support.check(job.config, support.Where("pipeline"), engine_only=True, call=call)


def refuse_unbuilt(action: str) -> NotBuiltError:
    """The error of ``job.<action>`` on a job not planned yet."""
    return NotBuiltError(
        f"job.{action} before the job is planned: a job made without example_batch= is planned "
        "at its first step(batch); call step first, or pass example_batch= to "
        "plait.parallelize to plan at once"
    )
