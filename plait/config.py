"""``ParallelConfig``: every knob of a parallel training job, validated at construction.

One frozen value, passed explicitly (never global state). An invalid value raises
:class:`~plait.errors.ConfigError` naming the field, the value and what is allowed. Knobs of
features that are not built yet are accepted here (so configs are stable) and refused by
:func:`plait.parallelize` with an error naming the feature; none is silently ignored.
"""

from __future__ import annotations

import difflib
import functools
import math
import os
import re
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any, Literal, get_args

from plait.errors import ConfigError, NotBuiltError

__all__ = ["SPLIT_BACKWARD", "CommFusion", "LogFormat", "ParallelConfig", "SparseOptimizer"]

Mode = Literal["stand_alone", "data_parallel", "semi_auto", "auto", "hybrid", "parameter_server"]
Search = Literal["sharding_propagation", "recursive_programming", "dynamic_programming", "ilp"]
Schedule = Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zero_bubble_v"]
Recompute = Literal["none", "full", "selective", "auto"]
Offload = Literal["optimizer", "parameters", "activations"]
Precision = Literal["fp32", "bf16", "fp16"]
Hardware = Literal["local", "a100-40g", "a100-80g", "h100", "h200", "ascend-910"]
DatasetStrategy = Literal["data_parallel", "full_batch"]
LogFormat = Literal["tensorboard", "jsonl"]
PsMode = Literal["sync", "async"]
PsSplit = Literal["range", "hash"]
SparseKind = Literal["sgd", "adagrad", "adam"]
SPLIT_BACKWARD = frozenset({"zero_bubble", "zero_bubble_v"})
"""Schedules that run the weight gradient as a pass of its own (Qi et al. 2023)."""

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def _allowed(kind: Any) -> str:
    return ", ".join(repr(a) for a in get_args(kind))


def _check_choice(name: str, value: object, kind: Any, optional: bool = False) -> None:
    if optional and value is None:
        return
    if value not in get_args(kind):
        extra = " or None" if optional else ""
        raise ConfigError(
            f"ParallelConfig.{name}={value!r} is not allowed; use one of {_allowed(kind)}{extra}"
        )


def _check_positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"ParallelConfig.{name}={value!r} is not allowed; use an integer >= 1")


def _sorted_names(name: str, given: Any, what: str) -> tuple[str, ...]:
    """A field holding names: sorted, without repeats; a bare string or non-names refused."""
    if isinstance(given, str) or not all(isinstance(n, str) for n in given):
        raise ConfigError(f"ParallelConfig.{name}={given!r}: give a tuple of {what}")
    return tuple(sorted(set(given)))


def parse_bytes(text: str | int, where: str = "memory_limit") -> int:
    """``"80GiB"`` -> 85899345920; integers are bytes."""
    if isinstance(text, int) and not isinstance(text, bool) and text > 0:
        return text
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).upper() if match else None
    if not match or unit not in _UNITS or float(match.group(1)) <= 0:
        raise ConfigError(
            f"ParallelConfig.{where}={text!r} is not a size; write bytes as an integer or a "
            "number with a unit, e.g. '80GiB' or '512MB'"
        )
    return int(float(match.group(1)) * _UNITS[unit])


@dataclass(frozen=True, kw_only=True, slots=True)
class CommFusion:
    """Gradient communication fusion (MindSpore ``comm_fusion``).

    ``mode="size"`` fuses gradients into buckets of ``bucket_mb`` megabytes; ``mode="index"``
    cuts buckets at the parameter indices in ``boundaries`` (in parameter order).
    """

    mode: Literal["size", "index"] = "size"
    """How buckets are formed."""
    bucket_mb: float = 25.0
    """Bucket size in MB for ``mode="size"``."""
    boundaries: tuple[int, ...] = ()
    """Parameter indices where a new bucket starts, for ``mode="index"``."""

    def __post_init__(self) -> None:
        if self.mode not in ("size", "index"):
            raise ConfigError(
                f"CommFusion.mode={self.mode!r} is not allowed; use 'size' or 'index'"
            )
        if not isinstance(self.bucket_mb, int | float) or self.bucket_mb <= 0:
            raise ConfigError(
                f"CommFusion.bucket_mb={self.bucket_mb!r} is not allowed; use a number > 0"
            )
        object.__setattr__(self, "boundaries", tuple(self.boundaries))
        b = self.boundaries
        if self.mode == "index" and (not b or list(b) != sorted(set(b)) or b[0] < 1):
            raise ConfigError(
                f"CommFusion.boundaries={b!r} is not allowed for mode 'index'; give strictly "
                "increasing parameter indices >= 1, e.g. (4, 8)"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class SparseOptimizer:
    """The optimizer a parameter server applies to the rows of its tables that a step touched
    (rows no batch used keep their values and states). Each kind is torch's own optimizer on
    the server's rows with a sparse gradient, so one device reaches the same table with
    ``nn.Embedding(..., sparse=True)`` and the same class:

    - ``"sgd"``: ``torch.optim.SGD(lr)`` (no momentum: its buffer would touch every row);
    - ``"adagrad"``: ``torch.optim.Adagrad(lr, lr_decay, initial_accumulator_value, eps)``;
    - ``"adam"``: ``torch.optim.SparseAdam(lr, betas, eps)``, Adam with lazy per-row moments.

    Example:
        >>> SparseOptimizer(kind="adagrad", lr=0.05).kind
        'adagrad'
    """

    kind: SparseKind = "adam"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    """``"adam"`` only."""
    eps: float = 1e-8
    """``"adam"`` (default 1e-8) and ``"adagrad"`` (torch's default is 1e-10: give it)."""
    lr_decay: float = 0.0
    """``"adagrad"`` only."""
    initial_accumulator_value: float = 0.0
    """``"adagrad"`` only."""

    def __post_init__(self) -> None:
        _check_choice("SparseOptimizer.kind", self.kind, SparseKind)
        if not isinstance(self.lr, int | float) or isinstance(self.lr, bool) or self.lr <= 0:
            raise ConfigError(f"SparseOptimizer.lr={self.lr!r} is not allowed; use a number > 0")
        betas = tuple(self.betas)
        if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
            raise ConfigError(
                f"SparseOptimizer.betas={self.betas!r} is not allowed; give two numbers in [0, 1)"
            )
        object.__setattr__(self, "betas", betas)
        defaults = SparseOptimizer.__dataclass_fields__
        unused = {
            "sgd": ("betas", "eps", "lr_decay", "initial_accumulator_value"),
            "adagrad": ("betas",),
            "adam": ("lr_decay", "initial_accumulator_value"),
        }[self.kind]
        for name in unused:
            if getattr(self, name) != defaults[name].default:
                raise ConfigError(
                    f"SparseOptimizer(kind={self.kind!r}, {name}={getattr(self, name)!r}): "
                    f"{self.kind!r} has no {name}; leave it out or choose the kind that has it"
                )


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelConfig:
    """How to split one training job across devices.

    Example:
        >>> cfg = ParallelConfig(mode="semi_auto", devices=4, mesh={"dp": 2, "tp": 2})
        >>> cfg.mesh_dict, cfg.data_parallel_size
        ({'dp': 2, 'tp': 2}, 2)
    """

    mode: Mode = "data_parallel"
    """stand_alone | data_parallel | semi_auto | auto | hybrid | parameter_server."""
    search: Search | None = None
    """Strategy searcher for mode 'auto' (None = sharding_propagation)."""
    devices: int | None = None
    """Number of devices (ranks); None = the world size at parallelize time."""
    mesh: Mapping[str, int] | None = None
    """Named mesh axes, outermost first, e.g. {"dp": 2, "tp": 2}; None = {dp_axis: devices}.
    The ``dp_axis`` may be -1: it takes the rest of the world (``{"dp": -1, "tp": 2}`` is
    dp=2 on 4 ranks, dp=4 on 8), so one config serves every size of an elastic job."""
    dp_axis: str = "dp"
    """The mesh axis that plays data parallel (the batch is split across it)."""
    pipeline_stages: int = 1
    """Number of pipeline stages; taken from the mesh's ``pp`` axis when that is given."""
    micro_batches: int = 1
    """Micro-batches per step for the pipeline."""
    schedule: Schedule = "1f1b"
    """Pipeline schedule: ``gpipe``, ``1f1b``, ``interleaved_1f1b`` (several stages a rank),
    ``zero_bubble`` (interleaved, backward split into input and weight gradients) or
    ``zero_bubble_v`` (two stages a rank in a V: rank r runs stages r and 2 pp - 1 - r)."""
    virtual_stages: int | None = None
    """Stages a rank runs (Megatron's virtual pipeline stages); None = 1 for ``gpipe`` and
    ``1f1b``, 2 for the interleaved and zero-bubble schedules. The model is cut into
    ``pipeline_stages * virtual_stages`` stages."""
    optimizer_shard: Literal[1, 2, 3] | None = None
    """Optimizer parallel level over ``dp_axis`` (MindSpore's ``optimizer_level``): 1 shards
    optimizer states, 2 also gradients (reduce-scatter), 3 also parameters (gathered before
    use in forward and again in backward, freed between); None = off."""
    optimizer_shard_exclude: tuple[str, ...] = ()
    """Parameters (by name) optimizer parallel keeps whole (MindSpore's
    ``Parameter.parallel_optimizer = False``, which plait also reads off a parameter)."""
    optimizer_shard_threshold: int | str = 64 * 1024
    """A parameter whose piece is smaller than this (bytes, or e.g. '64KiB') stays whole under
    ``optimizer_shard`` (MindSpore's ``parallel_optimizer_threshold``, 64 KB)."""
    optimizer_weight_shard_size: int | None = None
    """Ranks one parameter's shards spread over under ``optimizer_shard`` (MindSpore's
    ``optimizer_weight_shard_size``, HSDP): the ``dp_axis`` is cut into groups of this many
    consecutive ranks; each group holds one whole copy of the sharded states (and, at level 3,
    parameters); gradients are reduce-scattered inside a group and all-reduced across groups.
    Must divide the dp axis; None = the whole dp axis."""
    recompute: Recompute = "none"
    """Activation recompute for every repeated layer (transformer block): "full" recomputes
    its forward in backward, keeping only its inputs and outputs; "selective" keeps matrix
    products and recomputes the cheap ops; "none" keeps everything; "auto" takes the cheapest
    of none, selective, full whose predicted memory fits ``memory_limit`` (default: the
    hardware profile's device memory)."""
    recompute_modules: Mapping[str, str] | tuple[tuple[str, str], ...] = ()
    """Per-module recompute, module path -> "full" | "selective" (what ``plait.recompute``
    marks, MindSpore's ``Cell.recompute()``); held as sorted (path, mode) pairs."""
    grad_accumulation: int = 1
    """Micro-steps per optimizer step."""
    interleave_num: int | Literal["auto"] = 1
    """Multi-copy parallel (MindSpore's ``MicroBatchInterleaved(net, interleave_num)``): each
    micro-batch is cut into this many copies along dim 0, run as one program in which one
    copy's tensor-parallel collectives are in flight while another copy computes
    (:mod:`plait.runtime.program.interleave`). The plan is made for one copy's batch; the
    copies' gradients are summed inside the program and reduced once. 1 = off. ``"auto"``
    (mode auto only): the planner weighs 1 and 2 copies, each planned on its own batch
    piece, and keeps the faster (:func:`plait.planning.copies.weigh_copies`)."""
    comm_fusion: CommFusion | None = None
    """Gradient fusion buckets; None = plait's default."""
    offload: Offload | None = None
    """What to keep on the host between uses; None = nothing."""
    host_modules: tuple[str, ...] = ()
    """Modules (by path) kept and computed on the host, with their parameters, gradients and
    optimizer states (MindSpore's host and device heterogeneous training,
    ``Primitive.set_device("CPU")``): inputs are copied to the host and outputs back to the
    device. ``plait.on_host(module)`` marks one the same way."""
    precision: Precision = "fp32"
    """Compute precision (master weights and optimizer states stay fp32)."""
    hardware: Hardware | None = None
    """Hardware profile for the cost model (auto mode); None = 'local'."""
    memory_limit: int | str | None = None
    """Per-device memory cap for planning, bytes or e.g. '80GiB'."""
    dataset_strategy: DatasetStrategy | tuple[Any, ...] = "data_parallel"
    """How step() inputs are split: each rank passes its slice, or all pass the global batch."""
    plan: str | os.PathLike[str] | None = None
    """A saved plan file to run."""
    compile: bool = False
    """Run a plan's per-rank program through ``torch.compile`` (inductor), on real processes."""
    stage_programs: bool = True
    """Run pipeline stages as traced per-rank programs (graphs over local tensors, collectives
    explicit: :mod:`plait.runtime.pipeline.stage_program`), tensor parallel inside or not,
    where built; False keeps every stage eager (DTensor's per-op dispatch with tp, torch's
    checkpoint for recompute)."""
    log_dir: str | os.PathLike[str] | None = None
    """A directory where the process of global rank 0 writes one record per training step
    (step, loss, step time beside the plan's prediction, samples and tokens per second, peak
    memory, learning rate), as ``log_formats`` say (:mod:`plait.runtime.engine.metrics`); None = no
    metrics files (the demo's progress bar and ``job.report()`` are there either way)."""
    log_formats: tuple[LogFormat, ...] = ("tensorboard", "jsonl")
    """What ``log_dir`` gets: ``"tensorboard"`` event files (``tensorboard --logdir DIR``;
    needs ``pip install 'plait[metrics]'``) and ``"jsonl"``, ``DIR/metrics.jsonl`` (one JSON
    object a step, no extra package)."""
    server_modules: tuple[str, ...] = ()
    """``mode="parameter_server"``: the embedding tables (module paths, ``nn.Embedding`` or
    ``nn.EmbeddingBag``) held by the server ranks (MindSpore's ``set_param_ps``);
    ``plait.on_server(module)`` marks one the same way (:mod:`plait.ps`)."""
    ps_mode: PsMode = "sync"
    """``"sync"``: servers apply a step's row gradients once every worker pushed them (one
    device's training); ``"async"``: each push is applied when it arrives, a worker's pull
    waiting only for pushes more than ``max_staleness`` steps old."""
    max_staleness: int = 0
    """``ps_mode="async"``: how many steps a worker may run ahead of the slowest push applied."""
    server_optimizer: SparseOptimizer = field(default_factory=SparseOptimizer)
    """What the servers apply to the rows a step touched."""
    vocab_cache_size: int = 0
    """``mode="parameter_server"``: rows of each table a worker caches (MindSpore's
    ``vocab_cache_size``), the hottest kept, each reused while it is as fresh as ``ps_mode``
    allows (:mod:`plait.ps.cache`); ``job.parameter_server.prefetch`` fills it for the next
    step while this one computes. 0: every read pulls."""
    ps_split: PsSplit = "range"
    """How a table's rows are split over servers: ``"range"`` (server ``s`` holds the ``s``-th
    of equal consecutive blocks; the server count must divide the rows) or ``"hash"`` (row
    ``i`` on server ``i mod S``: consecutive hot ids spread over every server)."""
    _mesh: MappingProxyType[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._check_metrics()
        if not isinstance(self.stage_programs, bool):
            raise ConfigError(
                f"ParallelConfig.stage_programs={self.stage_programs!r}: give True or False "
                "(True runs pipeline stages as traced per-rank programs)"
            )
        if not isinstance(self.compile, bool):
            raise ConfigError(
                f"ParallelConfig.compile={self.compile!r}: give True or False (True runs a "
                "plan's per-rank program through torch.compile)"
            )
        self._check_choices()
        self._check_counts()
        self._check_parameter_server()
        object.__setattr__(self, "_mesh", MappingProxyType(self._resolve_mesh()))
        pp = self._mesh.get("pp", 1)
        if pp > 1 and self.pipeline_stages == 1:
            # the mesh's pp axis holds the stages: no need to say it twice
            object.__setattr__(self, "pipeline_stages", pp)
        self._check_virtual_stages()
        if self.memory_limit is not None:
            object.__setattr__(self, "memory_limit", parse_bytes(self.memory_limit))
        self._check_recompute_modules()
        exclude = _sorted_names("optimizer_shard_exclude", self.optimizer_shard_exclude,
                                "parameter names, e.g. ('tok.weight',)")  # fmt: skip
        object.__setattr__(self, "optimizer_shard_exclude", exclude)
        self._check_weight_shard_size()
        hosts = _sorted_names(
            "host_modules", self.host_modules, "module paths, e.g. ('embedding',)"
        )
        if "" in hosts:
            raise ConfigError(
                f"ParallelConfig.host_modules={hosts!r}: '' is the whole model (plait.on_host "
                "on the model itself); that is training on the CPU alone. Name the sub-modules "
                "to keep on the host, e.g. ('embedding',)"
            )
        object.__setattr__(self, "host_modules", hosts)
        threshold = self.optimizer_shard_threshold
        if threshold != 0:
            threshold = parse_bytes(threshold, "optimizer_shard_threshold")
        object.__setattr__(self, "optimizer_shard_threshold", threshold)
        if isinstance(self.comm_fusion, Mapping):
            try:
                object.__setattr__(self, "comm_fusion", CommFusion(**self.comm_fusion))
            except TypeError as e:
                raise ConfigError(f"ParallelConfig.comm_fusion={self.comm_fusion!r}: {e}") from None
        elif self.comm_fusion is not None and not isinstance(self.comm_fusion, CommFusion):
            raise ConfigError(
                f"ParallelConfig.comm_fusion={self.comm_fusion!r} is not allowed; use a CommFusion "
                "or a dict such as {'mode': 'size', 'bucket_mb': 25}"
            )

    def _check_metrics(self) -> None:
        formats = self.log_formats
        allowed = get_args(LogFormat)
        if (
            isinstance(formats, str)
            or not isinstance(formats, tuple | list)
            or not formats
            or any(f not in allowed for f in formats)
        ):
            raise ConfigError(
                f"ParallelConfig.log_formats={formats!r} is not allowed; give a non-empty tuple "
                f"of {_allowed(LogFormat)}, e.g. ('jsonl',)"
            )
        object.__setattr__(self, "log_formats", tuple(f for f in allowed if f in formats))
        log_dir = self.log_dir
        if log_dir is None:
            if self.log_formats != allowed:
                raise ConfigError(
                    f"ParallelConfig(log_formats={self.log_formats!r}) without log_dir writes "
                    "nothing; give log_dir='DIR' (where the metrics go) or leave log_formats out"
                )
            return
        if not isinstance(log_dir, str | os.PathLike) or not os.fspath(log_dir):
            raise ConfigError(
                f"ParallelConfig.log_dir={log_dir!r} is not allowed; give a directory path "
                "(created if missing), e.g. 'runs/gpt'"
            )

    def _check_weight_shard_size(self) -> None:
        size = self.optimizer_weight_shard_size
        if size is None:
            return
        _check_positive_int("optimizer_weight_shard_size", size)
        if self.optimizer_shard is None:
            raise ConfigError(
                f"ParallelConfig.optimizer_weight_shard_size={size} needs optimizer_shard: give "
                "optimizer_shard=1, 2 or 3, or leave optimizer_weight_shard_size out"
            )
        dp = self._mesh.get(self.dp_axis)
        if dp is not None and dp > 0 and dp % size:  # -1: checked once sized (for_world)
            raise ConfigError(
                f"ParallelConfig.optimizer_weight_shard_size={size} does not divide the "
                f"{self.dp_axis!r} axis ({dp} ranks): give a divisor of {dp}, e.g. "
                f"{max(d for d in range(1, dp + 1) if dp % d == 0 and d <= size)}"
            )

    def _check_recompute_modules(self) -> None:
        given = self.recompute_modules
        pairs = list(given.items()) if isinstance(given, Mapping) else list(given)
        for pair in pairs:
            ok = isinstance(pair, tuple | list) and len(pair) == 2 and isinstance(pair[0], str)
            if not ok or pair[1] not in ("full", "selective"):
                raise ConfigError(
                    f"ParallelConfig.recompute_modules={given!r}: each entry maps a module path "
                    "to 'full' or 'selective', e.g. {'blocks.0': 'full'}"
                )
        object.__setattr__(self, "recompute_modules", tuple(sorted((p, m) for p, m in pairs)))

    def _check_choices(self) -> None:
        _check_choice("mode", self.mode, Mode)
        _check_choice("search", self.search, Search, optional=True)
        _check_choice("schedule", self.schedule, Schedule)
        _check_choice("recompute", self.recompute, Recompute)
        _check_choice("offload", self.offload, Offload, optional=True)
        _check_choice("precision", self.precision, Precision)
        _check_choice("hardware", self.hardware, Hardware, optional=True)
        if self.optimizer_shard not in (None, 1, 2, 3) or isinstance(self.optimizer_shard, bool):
            raise ConfigError(
                f"ParallelConfig.optimizer_shard={self.optimizer_shard!r} is not allowed; use 1, 2, 3 or None"
            )
        ds = self.dataset_strategy
        if not (ds in get_args(DatasetStrategy) or isinstance(ds, tuple)):
            raise ConfigError(
                f"ParallelConfig.dataset_strategy={ds!r} is not allowed; use "
                f"{_allowed(DatasetStrategy)} or a tuple of per-input strategies"
            )
        if self.plan is not None and not isinstance(self.plan, str | os.PathLike):
            raise ConfigError(
                f"ParallelConfig.plan={self.plan!r} is not allowed; give a path to a plan file"
            )

    def _check_virtual_stages(self) -> None:
        looped = self.schedule in ("gpipe", "1f1b")
        if self.virtual_stages is None:
            object.__setattr__(self, "virtual_stages", 1 if looped else 2)
            return
        _check_positive_int("virtual_stages", self.virtual_stages)
        if looped and self.virtual_stages != 1:
            raise ConfigError(
                f"ParallelConfig(schedule={self.schedule!r}, virtual_stages="
                f"{self.virtual_stages}): {self.schedule} runs one stage a rank; use "
                "schedule='interleaved_1f1b' for several, or leave virtual_stages out"
            )
        if not looped and self.virtual_stages < 2:
            raise ConfigError(
                f"ParallelConfig(schedule={self.schedule!r}, virtual_stages=1): this schedule "
                "runs several stages a rank; give virtual_stages >= 2 or leave it out (2)"
            )
        if self.schedule == "zero_bubble_v" and self.virtual_stages != 2:
            raise ConfigError(
                f"ParallelConfig(schedule='zero_bubble_v', virtual_stages="
                f"{self.virtual_stages}): the V schedule runs exactly 2 stages a rank; leave "
                "virtual_stages out"
            )

    def _check_parameter_server(self) -> None:
        _check_choice("ps_mode", self.ps_mode, PsMode)
        _check_choice("ps_split", self.ps_split, PsSplit)
        if isinstance(self.server_optimizer, Mapping):
            try:
                built = SparseOptimizer(**self.server_optimizer)
            except TypeError as e:
                raise ConfigError(
                    f"ParallelConfig.server_optimizer={self.server_optimizer!r}: {e}"
                ) from None
            object.__setattr__(self, "server_optimizer", built)
        elif not isinstance(self.server_optimizer, SparseOptimizer):
            raise ConfigError(
                f"ParallelConfig.server_optimizer={self.server_optimizer!r} is not allowed; give "
                "a plait.SparseOptimizer, e.g. SparseOptimizer(kind='adagrad', lr=0.05)"
            )
        staleness = self.max_staleness
        for name in ("max_staleness", "vocab_cache_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(
                    f"ParallelConfig.{name}={value!r} is not allowed; use an integer >= 0"
                )
        servers = _sorted_names("server_modules", self.server_modules,
                                "module paths, e.g. ('user_table',)")  # fmt: skip
        object.__setattr__(self, "server_modules", servers)
        if self.mode != "parameter_server":
            given = {
                name: getattr(self, name)
                for name, default in _field_defaults(type(self), _PS_FIELDS).items()
                if getattr(self, name) != default
            }
            if given:
                field_name, value = next(iter(given.items()))
                raise ConfigError(
                    f"ParallelConfig({field_name}={value!r}) with mode={self.mode!r} would do "
                    "nothing: it sets up parameter servers; give mode='parameter_server' or "
                    f"leave {field_name} out"
                )
        elif staleness and self.ps_mode == "sync":
            raise ConfigError(
                f"ParallelConfig(max_staleness={staleness}) with ps_mode='sync' would do "
                "nothing: sync servers apply every step before the next pull; give "
                "ps_mode='async' or leave max_staleness out"
            )

    def _check_counts(self) -> None:
        for name in ("pipeline_stages", "micro_batches", "grad_accumulation"):
            _check_positive_int(name, getattr(self, name))
        if self.interleave_num != "auto":
            _check_positive_int("interleave_num", self.interleave_num)
        elif self.mode != "auto":
            raise ConfigError(
                f"ParallelConfig(interleave_num='auto') with mode={self.mode!r}: only mode "
                "'auto' searches the copy count; give mode='auto' or a count (1 = off, 2 = two "
                "copies)"
            )
        if self.devices is not None:
            _check_positive_int("devices", self.devices)
        if not isinstance(self.dp_axis, str) or not self.dp_axis:
            raise ConfigError(
                f"ParallelConfig.dp_axis={self.dp_axis!r} is not allowed; use an axis name"
            )

    def _resolve_mesh(self) -> dict[str, int]:
        if self.mesh is None:
            return {self.dp_axis: self.devices} if self.devices is not None else {}
        if not isinstance(self.mesh, Mapping) or not self.mesh:
            raise ConfigError(
                f"ParallelConfig.mesh={self.mesh!r} is not allowed; use a dict of axis name to "
                "size, e.g. {'dp': 2, 'tp': 2}"
            )
        for name, size in self.mesh.items():
            if not isinstance(name, str) or not name or name == "None":
                raise ConfigError(
                    f"ParallelConfig.mesh axis name {name!r} is not allowed; use a non-empty string"
                )
            if size == -1 and name == self.dp_axis and not isinstance(size, bool):
                continue  # the rest of the world: resolved by for_world
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ConfigError(
                    f"ParallelConfig.mesh[{name!r}]={size!r} is not allowed; sizes are integers"
                    f" >= 1, or -1 on the data-parallel axis ({self.dp_axis!r}) for the rest of"
                    " the world"
                )
        if self.mesh.get(self.dp_axis) == -1:
            if self.devices is None:
                return dict(self.mesh)  # parallelize resolves it on the world (for_world)
            return self._rest_to_dp(self.devices)
        total = math.prod(self.mesh.values())
        if self.devices is not None and total != self.devices:
            raise ConfigError(
                f"ParallelConfig.mesh={dict(self.mesh)!r} has {total} devices but devices={self.devices}; "
                "make the product of the mesh sizes equal devices"
            )
        return dict(self.mesh)

    def _rest_to_dp(self, world_size: int) -> dict[str, int]:
        """The mesh with the -1 data-parallel axis given the rest of ``world_size`` ranks."""
        assert self.mesh is not None
        others = math.prod(size for name, size in self.mesh.items() if name != self.dp_axis)
        if world_size % others:
            raise ConfigError(
                f"ParallelConfig.mesh={dict(self.mesh)!r} on {world_size} ranks: the other axes"
                f" take {others} ranks, which does not divide {world_size}, so "
                f"{self.dp_axis}=-1 has no size; run a multiple of {others} ranks"
            )
        return {
            name: world_size // others if name == self.dp_axis else size
            for name, size in self.mesh.items()
        }

    def for_world(self, world_size: int) -> ParallelConfig:
        """This config on a world of ``world_size`` ranks: a -1 data-parallel axis sized.

        Example:
            >>> ParallelConfig(mode="semi_auto", mesh={"dp": -1, "tp": 2}).for_world(8).mesh_dict
            {'dp': 4, 'tp': 2}
        """
        if self.mesh is None or self.mesh.get(self.dp_axis) != -1:
            return self
        return replace(self, mesh=self._rest_to_dp(world_size))

    @property
    def mesh_dict(self) -> dict[str, int]:
        """The mesh as a plain dict (empty when it is left to the world size)."""
        return dict(self._mesh)

    @property
    def planned_pieces(self) -> int:
        """Pieces a step's batch is cut into along dim 0, the plan made for one: the
        ``grad_accumulation`` micro-steps, each of ``interleave_num`` copies (a count:
        ``"auto"`` is resolved by the planner first, :attr:`copies`)."""
        return self.grad_accumulation * self.copies

    @property
    def copies(self) -> int:
        """``interleave_num`` as a count; ``"auto"`` has none until the planner picks one."""
        if self.interleave_num == "auto":
            raise ConfigError(
                "ParallelConfig(interleave_num='auto') has no copy count before planning: "
                "plan with plait.plan or plait.parallelize (mode 'auto'), which pick one"
            )
        return self.interleave_num

    @property
    def data_parallel_size(self) -> int:
        return self._mesh.get(self.dp_axis, 1)

    @property
    def compiled_stages(self) -> bool:
        """Whether pipeline stages (tensor parallel inside or not) run as compiled per-rank
        programs under these settings (:mod:`plait.runtime.pipeline.stage_program`): ``stage_programs``
        on, and not optimizer parallel beside mixed precision. Mixed precision is traced under
        the stage's autocast; recompute, the stage's or its modules', is a pass over its
        traced graph; activation offload moves what the program saves; optimizer parallel
        gathers the parameters (FSDP2) before the program's call and reduce-scatters its
        gradients after. FSDP2's low-precision gathers beside autocast do not trace yet (the
        trace meets products of bf16 and fp32 pieces): those stages run op by op. The one
        rule the runtime builds by and the outer planner weighs zero-bubble plans by."""
        return self.stage_programs and (self.optimizer_shard is None or self.precision == "fp32")

    def non_default_fields(self) -> dict[str, Any]:
        """Fields whose values differ from their defaults (for errors and logs)."""
        defaults = ParallelConfig()
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.init and getattr(self, f.name) != getattr(defaults, f.name)
        }


_PS_FIELDS = (
    "server_modules", "ps_mode", "max_staleness", "server_optimizer", "vocab_cache_size",
    "ps_split",
)  # fmt: skip
"""ParallelConfig's fields that set up parameter servers (refused with another mode)."""


def _field_defaults(cls: type, names: tuple[str, ...]) -> dict[str, Any]:
    """The defaults ``cls`` (a dataclass) gives fields ``names``, as its constructor would."""
    out: dict[str, Any] = {}
    for f in fields(cls):
        if f.name not in names:
            continue
        factory = f.default_factory
        out[f.name] = f.default if factory is MISSING else factory()
    return out


# Options users of the field (MindSpore's auto-parallel context, Megatron, torchtitan) write
# that plait has not built yet: each names what it is, so a config asking for it is refused
# by name (a NotBuiltError), not with Python's "unexpected keyword argument".
NOT_BUILT_FIELDS: Mapping[str, str] = MappingProxyType(
    {
        "context_parallel": "context parallel (ring attention over a 'cp' axis)",
        "expert_parallel": "expert parallel (mixture-of-experts layers over an 'ep' axis)",
        "elastic": "elastic training (scaling the world in and out between steps)",
        "enable_alltoall": "all-to-all redistribution (MindSpore's enable_alltoall)",
        "mp_comm_recompute": "re-issuing tensor-parallel collectives under recompute",
        "parameter_broadcast": "broadcasting parameters from rank 0 (plait builds them alike "
        "on every rank from the same seed)",
    }
)
# Other tools' names for fields plait has, for "did you mean".
_SAME_AS: Mapping[str, str] = MappingProxyType(
    {
        "parallel_mode": "mode",
        "parameter_server": "mode='parameter_server'",
        "enable_ps": "mode='parameter_server'",
        "device_num": "devices",
        "search_mode": "search",
        "full_batch": "dataset_strategy='full_batch'",
        "enable_parallel_optimizer": "optimizer_shard",
        "optimizer_level": "optimizer_shard",
        "parallel_optimizer_threshold": "optimizer_shard_threshold",
        "pipeline_config": "schedule",
        "pipeline_parallel_degree": "mesh={'pp': N}",
        "tensor_parallel_degree": "mesh={'tp': N}",
        "data_parallel_degree": "mesh={'dp': N}",
        "gradient_accumulation_steps": "grad_accumulation",
        "micro_batch_num": "micro_batches",
        "multi_copy": "interleave_num",
        "micro_batch_interleaved": "interleave_num",
        "mixed_precision": "precision",
        "activation_checkpointing": "recompute",
        "sequence_parallel": "plait.annotate.megatron(model, tp, sequence_parallel=True) (or "
        "plait.annotate.split_sequence on your own modules: a mark on the model, not a field)",
    }
)


def _refuse_unknown_fields(given: Mapping[str, Any]) -> None:
    """A keyword ParallelConfig does not have: refused by name, with what to write instead."""
    known = {f.name for f in fields(ParallelConfig) if f.init}
    for name in given:
        if name in known:
            continue
        if name in NOT_BUILT_FIELDS:
            raise NotBuiltError(
                f"ParallelConfig({name}=...): {NOT_BUILT_FIELDS[name]} is not built in this "
                "version of plait yet; leave the field out"
            )
        hint = _SAME_AS.get(name) or next(iter(difflib.get_close_matches(name, known, 1)), None)
        raise ConfigError(
            f"ParallelConfig got an unknown field {name!r}"
            + (f"; did you mean {hint}?" if hint else "")
            + f" (its fields: {', '.join(sorted(known))})"
        )


def _with_known_fields(init: Any) -> Any:
    """``ParallelConfig.__init__`` refusing unknown keywords by name before dataclass's."""

    @functools.wraps(init)
    def checked(self: ParallelConfig, *args: Any, **kwargs: Any) -> None:
        _refuse_unknown_fields(kwargs)
        init(self, *args, **kwargs)

    return checked


ParallelConfig.__init__ = _with_known_fields(ParallelConfig.__init__)  # type: ignore[method-assign]


def parameter_server_defaults() -> dict[str, Any]:
    """ParallelConfig's parameter-server fields at their defaults (what a parameter-server
    job's dense part is planned with, beside ``mode="data_parallel"``)."""
    return _field_defaults(ParallelConfig, _PS_FIELDS)
