"""Capture takes the models users write, and mode auto trains them like one device.

Hugging Face models are built from tiny configs (random weights) and called the way their
docs show, with the model's own loss (``m(**batch).loss``, ``labels=`` in the batch, no
hand-made attention mask), under whichever transformers is installed (the 5.x line or 4.57;
docs/models.md, "Transformers versions"): transformers 4.x builds the causal mask with
``torch.vmap``, keeps tensor literals (``torch.tensor([])`` of its key/value cache, T5's
shifted labels) and pads labels for the shifted loss; 5.x runs T5's attention through
``scaled_dot_product_attention`` (a ``view`` that held only for export's strides) and Mixtral's
experts through one grouped matmul (static shapes). Small plain models cover what a forward
may contain besides: ``torch.vmap``, ``torch.cond``, reentrant activation checkpoints, tensor
literals, a view that relied on a kernel's output layout, an op without a rule on a mesh
axis of size one. Each trains under ``simulate(4)`` in mode auto
and equals single-device training (losses and final parameters, fp32, rtol 1e-4).

Optimizers: SGD where a parameter has an exactly zero gradient (a key bias: softmax ignores a
constant per row; a convolution bias before batch norm), since Adam turns rounding noise in
such a gradient into lr-sized steps; AdamW elsewhere.

Value-dependent sizes and branches (boolean-mask indexing, a Python ``if`` on a value,
Mixtral's expert loop, BART's layer drop) are refused by a CaptureError naming the module,
the line and the way out; higher-order ops plait does not inline are refused by name.

The larger cases (every architecture on dp=2 x tp=2, dp=4 and tp=4 with the four searchers
in turn, Hugging Face gradient checkpointing, padding attention masks; Mixtral and BART, which
train from transformers 5 on) are ``nightly``.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.metadata
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

import plait
from plait.config import ParallelConfig
from plait.errors import CaptureError, ShardingError
from plait.graph import capture_program
from plait.planning import Plan
from plait.rules.catalogue import default_catalogue
from plait.testing.equivalence import Run, assert_same_run, parallel_steps, reference_run

Batch = Any
LossFn = Callable[[nn.Module, Batch], torch.Tensor]
Optimizer = Callable[..., torch.optim.Optimizer]

DP_TP = {"dp": 2, "tp": 2}
DP = {"dp": 4}
TP = {"dp": 1, "tp": 4}
SEARCHERS = ("sharding_propagation", "recursive_programming", "dynamic_programming", "ilp")
VOCAB, SEQ, BATCH, STEPS = 64, 8, 4, 2


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01, eps=1e-6)


def own_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's own loss, as Hugging Face's docs call it: ``model(**batch).loss``."""
    return model(**batch).loss


def _train(
    model: nn.Module,
    loss_fn: LossFn,
    optimizer: Optimizer,
    batches: list[Batch],
    mesh: dict,
    search: str | None = None,
) -> tuple[Run, Plan]:
    """Train a copy of ``model`` in mode auto on 4 simulated ranks: the run and its plan."""
    model = copy.deepcopy(model)
    with plait.testing.simulate(4):
        job = plait.parallelize(
            model,
            ParallelConfig(mode="auto", mesh=mesh, search=search),
            optimizer=optimizer,
            loss_fn=loss_fn,
            example_batch=batches[0],
        )
        run = parallel_steps(job, batches)
    return run, job.loss_fn.plan


def assert_trains_like_one_device(
    model: nn.Module,
    loss_fn: LossFn,
    optimizer: Optimizer,
    batches: list[Batch],
    mesh: dict,
    search: str | None = None,
) -> Plan:
    expected = reference_run(model, loss_fn, optimizer, batches)
    actual, plan = _train(model, loss_fn, optimizer, batches, mesh, search)
    assert_same_run(expected, actual, rtol=1e-4, atol=1e-5)
    return plan


# --------------------------------------------------------------------------- Hugging Face


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ))


def _causal_lm() -> Batch:
    ids = _ids()
    return {"input_ids": ids, "labels": ids}


def _masked_lm() -> Batch:
    ids = _ids()
    labels = ids.clone()
    labels[:, ::2] = -100  # only the "masked" positions are predicted
    return {"input_ids": ids, "labels": labels}


def _seq2seq() -> Batch:
    return {"input_ids": _ids(), "labels": _ids()}


def transformers_major() -> int:
    """The installed transformers' major version (0 when it is not installed)."""
    try:
        return int(importlib.metadata.version("transformers").split(".")[0])
    except importlib.metadata.PackageNotFoundError:
        return 0


def _images() -> Batch:
    return {"pixel_values": torch.randn(BATCH, 3, 16, 16), "labels": torch.randint(0, 10, (BATCH,))}


@dataclasses.dataclass(frozen=True)
class HFCase:
    """A tiny Hugging Face model: config and model class names in ``transformers``."""

    config: str
    fields: dict[str, Any]
    model: str
    batch: Callable[[], Batch]
    optimizer: Optimizer
    since: int = 4  # the transformers major version from which it trains


_DECODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64)
_HEADS = dict(num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=32)
_GPT2 = dict(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=1, n_head=4)
_T5 = dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4)
_VIT = dict(image_size=16, patch_size=4, num_channels=3, num_labels=10)
_NO_DROPOUT = {
    "gpt2": dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "gpt_neox": dict(hidden_dropout=0.0, attention_dropout=0.0),
    "phi": dict(resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0),
    "bert": dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
    "t5": dict(dropout_rate=0.0),
    "bart": dict(dropout=0.0, attention_dropout=0.0, activation_dropout=0.0),
}
_BART = dict(
    vocab_size=VOCAB,
    d_model=32,
    encoder_layers=1,
    decoder_layers=1,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    max_position_embeddings=32,
)
HF = {
    "llama": HFCase(
        "LlamaConfig",
        {**_DECODER, **_HEADS, "num_key_value_heads": 2},
        "LlamaForCausalLM",
        _causal_lm,
        adamw,
    ),
    # c_attn's bias holds the key bias (an exactly zero gradient): SGD
    "gpt2": HFCase(
        "GPT2Config", {**_GPT2, **_NO_DROPOUT["gpt2"]}, "GPT2LMHeadModel", _causal_lm, sgd
    ),
    "mistral": HFCase(
        "MistralConfig",
        {**_DECODER, **_HEADS, "num_key_value_heads": 2, "sliding_window": 4},
        "MistralForCausalLM",
        _causal_lm,
        adamw,
    ),
    "qwen2": HFCase(  # k_proj has a bias: SGD
        "Qwen2Config",
        {**_DECODER, **_HEADS, "num_key_value_heads": 2},
        "Qwen2ForCausalLM",
        _causal_lm,
        sgd,
    ),
    "gpt_neox": HFCase(
        "GPTNeoXConfig",
        {**_DECODER, **_HEADS, **_NO_DROPOUT["gpt_neox"]},
        "GPTNeoXForCausalLM",
        _causal_lm,
        sgd,
    ),
    "phi": HFCase(
        "PhiConfig", {**_DECODER, **_HEADS, **_NO_DROPOUT["phi"]}, "PhiForCausalLM", _causal_lm, sgd
    ),
    "bert": HFCase(
        "BertConfig",
        {**_DECODER, **_HEADS, **_NO_DROPOUT["bert"]},
        "BertForMaskedLM",
        _masked_lm,
        sgd,
    ),
    "t5": HFCase(  # labels shifted right in place: functionalized at capture
        "T5Config",
        {**_T5, **_NO_DROPOUT["t5"], "decoder_start_token_id": 0},
        "T5ForConditionalGeneration",
        _seq2seq,
        sgd,
    ),
    "vit": HFCase(
        "ViTConfig",
        {**_DECODER, **_HEADS, **_NO_DROPOUT["bert"], **_VIT, "vocab_size": None},
        "ViTForImageClassification",
        _images,
        sgd,
    ),
    # transformers 5 runs the experts as one grouped matmul (static shapes; sort, histc and
    # the matmul run replicated); 4.x loops over the experts hit: refused (below)
    "mixtral": HFCase(
        "MixtralConfig",
        {**_DECODER, **_HEADS, "num_key_value_heads": 2, "num_local_experts": 4},
        "MixtralForCausalLM",
        _causal_lm,
        sgd,
        since=5,
    ),
    # transformers 5 draws the layer-drop number only when layerdrop > 0; 4.x always: refused
    "bart": HFCase(
        "BartConfig",
        {**_BART, **_NO_DROPOUT["bart"]},
        "BartForConditionalGeneration",
        _seq2seq,
        sgd,
        since=5,
    ),
}


def hf_case(arch: str) -> tuple[nn.Module, list[Batch], Optimizer]:
    """A tiny Hugging Face model of ``arch`` (random weights), its batches and optimizer."""
    transformers = pytest.importorskip("transformers")
    case = HF[arch]
    if transformers_major() < case.since:
        pytest.skip(f"{arch} trains from transformers {case.since} on (refused before)")
    fields = {k: v for k, v in case.fields.items() if v is not None}
    torch.manual_seed(0)
    model = getattr(transformers, case.model)(getattr(transformers, case.config)(**fields))
    return model, [case.batch() for _ in range(STEPS)], case.optimizer


def test_hf_llama_with_labels_trains_like_one_device() -> None:
    """The headline case: no attention mask, so transformers builds the causal mask (4.x with
    torch.vmap, 5.x by broadcasting); 4.x's DynamicCache concatenates to a literal
    ``torch.tensor([])``."""
    model, batches, optimizer = hf_case("llama")
    plan = assert_trains_like_one_device(model, own_loss, optimizer, batches, DP_TP)
    assert all(op.target.startswith("aten.") for op in plan.ops)
    assert not {"aten.lift_fresh_copy.default", "aten.detach_.default"} & {
        op.target for op in plan.ops
    }


def test_hf_gpt2_with_labels_trains_like_one_device() -> None:
    """GPT-2's loss pads the labels (``F.pad(labels, (0, 1), value=-100)``): the pad rule
    keeps the padded sequence dim whole and may split the batch dim."""
    model, batches, optimizer = hf_case("gpt2")
    plan = assert_trains_like_one_device(model, own_loss, optimizer, batches, DP_TP)
    (pad,) = [op for op in plan.ops if op.target == "aten.pad.default"]
    assert pad.covered
    assert pad.inputs[0].dims[1] == ()  # the padded dim


# The nightly matrix: every architecture on dp=2 x tp=2, dp=4 and tp=4, the searcher turning
# with architecture and mesh (a Latin square: every searcher on every mesh, each architecture
# under three of the four), so all twelve searcher x mesh pairs run.
_MESHES = (("dp2xtp2", DP_TP), ("dp4", DP), ("tp4", TP))


def _case(i: int, arch: str, j: int, name: str, mesh: dict) -> Any:
    search = SEARCHERS[(i + j) % len(SEARCHERS)]
    return pytest.param(arch, mesh, search, marks=pytest.mark.nightly, id=f"{arch}-{name}-{search}")


_NIGHTLY = [
    _case(i, arch, j, name, mesh)
    for i, arch in enumerate(HF)
    for j, (name, mesh) in enumerate(_MESHES)
    if (arch, name) not in {("llama", "dp2xtp2"), ("gpt2", "dp2xtp2")}
]


@pytest.mark.parametrize(("arch", "mesh", "search"), _NIGHTLY)
def test_hf_architecture_trains_like_one_device(arch: str, mesh: dict, search: str) -> None:
    """On a mesh with tp the model is first annotated by ``plait.annotate.megatron`` (the
    searcher plans every other op around those marks): unannotated, these tiny models are
    cheapest fully replicated on the cost model, which would test no split at all. A model
    whose heads do not divide over tp is refused by name and trains unannotated."""
    model, batches, optimizer = hf_case(arch)
    tp = mesh.get("tp", 1)
    annotated = False
    if tp > 1:
        try:
            report = plait.annotate.megatron(model, tp)
            annotated = bool(report.matched)
        except ShardingError as e:
            assert "heads" in str(e), str(e)
    plan = assert_trains_like_one_device(model, own_loss, optimizer, batches, mesh, search)
    assert plan.search == search
    if annotated:  # the marks really split ops over tp
        assert any("tp" in axes for op in plan.ops for t in op.inputs for axes in t.dims)


@pytest.mark.nightly
@pytest.mark.parametrize("reentrant", [None, True], ids=["default", "reentrant"])
def test_hf_gradient_checkpointing_trains_like_one_device(reentrant: bool | None) -> None:
    """Activation checkpointing as transformers enables it: ``activation_checkpointing_enable``
    (5.x; non-reentrant by default) or ``gradient_checkpointing_enable`` (4.x; reentrant by
    default). Traced as it is, a reentrant checkpoint's layers would run under no_grad and get
    no gradient."""
    model, batches, optimizer = hf_case("llama")
    kwargs = None if reentrant is None else {"use_reentrant": reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(kwargs)
    else:
        model.gradient_checkpointing_enable(kwargs)
    model.train()
    assert_trains_like_one_device(model, own_loss, optimizer, batches, DP_TP)


def _padded(batches: list[Batch]) -> list[Batch]:
    """The batches with a tokenizer's attention mask (some sequences end in padding) and the
    padded positions' labels ignored."""
    out = []
    for batch in batches:
        mask = torch.ones_like(batch["input_ids"])
        mask[0, -3:] = 0
        mask[2, -1:] = 0
        labels = batch["labels"].masked_fill(mask == 0, -100)
        out.append({**batch, "attention_mask": mask, "labels": labels})
    return out


@pytest.mark.nightly
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_hf_padding_mask_trains_like_one_device(arch: str) -> None:
    """With an attention mask the mask builder indexes the padding mask by value
    (``padding_mask[batch_idx, kv_idx]``; in 4.x a ``flat_apply`` inside the vmap, retraced):
    ``aten.index``, which runs replicated."""
    model, batches, optimizer = hf_case(arch)
    plan = assert_trains_like_one_device(model, own_loss, optimizer, _padded(batches), DP_TP)
    assert "aten.index.Tensor" in {op.target for op in plan.ops if not op.covered}


# --------------------------------------------------------------------------- plain models


def _cnn() -> nn.Module:
    """A small image classifier without torchvision: conv, batch norm, pooling, linear."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )


def _classify(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    images, labels = batch
    return F.cross_entropy(model(images), labels)


@pytest.mark.nightly
@pytest.mark.parametrize(
    ("mesh", "search"),
    [(DP_TP, "ilp"), (DP, "sharding_propagation"), (TP, "recursive_programming")],
    ids=["dp2xtp2-ilp", "dp4-sharding_propagation", "tp4-recursive_programming"],
)
def test_small_cnn_trains_like_one_device(mesh: dict, search: str) -> None:
    """SGD: the first convolution's bias feeds batch norm (an exactly zero gradient)."""
    torch.manual_seed(0)
    batches = [(torch.randn(BATCH, 3, 16, 16), torch.randint(0, 10, (BATCH,))) for _ in range(2)]
    assert_trains_like_one_device(_cnn(), _classify, sgd, batches, mesh, search)


def _regression(n: int = STEPS, width: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(1)
    return [(torch.randn(8, width), torch.randn(8, width)) for _ in range(n)]


def mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


class _Vmapped(nn.Module):
    """A per-row function applied with torch.vmap between two linears."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.vmap(lambda row: row * torch.softmax(row, dim=0))(self.fc1(x))
        return self.fc2(h)


class _Conditional(nn.Module):
    """torch.cond on a value: both branches are computed, the output chosen by torch.where."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        h = torch.cond(h.mean() > 0, lambda t: torch.tanh(t), lambda t: 2 * t, (h,))
        return self.fc2(h)


_COND = torch.cond  # bound before capture, as ``from torch import cond`` would be


class _BoundCond(nn.Module):
    """A cond the capture cannot swap: export records a ``higher_order.cond`` node."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return _COND(h.mean() > 0, lambda t: torch.tanh(t), lambda t: 2 * t, (h,))


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_cond_node_becomes_where(sign: float) -> None:
    """The node's branches are inlined and the output chosen by ``where``: the captured
    program computes what the model does, whichever branch the value takes."""
    torch.manual_seed(0)
    model = _BoundCond()
    with torch.no_grad():
        model.fc.bias.fill_(10.0 * sign)  # the mean's sign picks the branch
    x = torch.randn(4, 8)
    captured = capture_program(model, x)
    targets = {str(n.target) for n in captured.program.graph.nodes}
    assert "aten.where.self" in targets and not any("cond" in t for t in targets)
    torch.testing.assert_close(captured.program.module()(x), model(x))


class _Checkpointed(nn.Module):
    """One block checkpointed the non-reentrant way, one the reentrant way (Hugging Face's
    default); with ``frozen_first`` both are reentrant and the first reads the batch, which
    needs no gradient: on one device neither block's parameters get one."""

    def __init__(self, frozen_first: bool = False) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 8)
        self.frozen_first = frozen_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        checkpoint = torch.utils.checkpoint.checkpoint
        first = lambda t: torch.relu(self.fc1(t))  # noqa: E731
        h = checkpoint(first, x, use_reentrant=self.frozen_first)
        h = checkpoint(lambda t: torch.tanh(self.fc2(t)), h, use_reentrant=True)
        return self.fc3(h)


class _Literals(nn.Module):
    """Tensor literals: a constant vector, and a column set from a 0-d literal in place."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 4), nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x) * torch.tensor([1.0, 0.5, 2.0, -1.0])
        fixed = torch.zeros_like(h)
        fixed[:, 0] = torch.tensor(3.0)
        return self.fc2(h + fixed)


@pytest.mark.parametrize(
    ("model_cls", "absent"),
    [
        (_Vmapped, "vmap"),
        (_Conditional, "cond"),
        (_Checkpointed, "checkpoint"),
        (_Literals, "lift_fresh_copy"),
    ],
    ids=["vmap", "cond", "checkpoint", "literals"],
)
def test_what_users_write_trains_like_one_device(model_cls: type[nn.Module], absent: str) -> None:
    torch.manual_seed(0)
    model = model_cls()
    batches = _regression()
    captured = capture_program(model, batches[0], mse)
    targets = " ".join(str(n.target) for n in captured.program.graph.nodes)
    assert absent not in targets and "_functorch" not in targets
    assert all(op.target.startswith("aten.") for op in captured.graph.ops)
    plan = assert_trains_like_one_device(model, mse, sgd, batches, DP_TP)
    assert all(op.covered for op in plan.ops), [op.target for op in plan.ops if not op.covered]


class _KernelLayout(nn.Module):
    """Attention as transformers 5's T5 writes it: ``transpose(1, 2).contiguous().reshape``
    after CPU's ``scaled_dot_product_attention``, whose output layout makes the transpose
    contiguous already; a write into a view (``x[:, 0] = 0``) has the program functionalized,
    which turns that reshape into a ``view`` valid only for the kernel's strides."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(8, 24), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        x = x.clone()
        x[:, 0] = 0.0
        q, k, v = self.qkv(x).view(b, t, 3, 2, 4).permute(2, 0, 3, 1, 4)
        h = F.scaled_dot_product_attention(q, k, v)
        return self.out(h.transpose(1, 2).contiguous().reshape(b, t, -1))


def test_view_that_relied_on_a_kernel_layout_trains_like_one_device() -> None:
    """The view of the transposed attention output is a reshape again: DTensor lays the
    attention output out contiguously, where the view would fail."""
    torch.manual_seed(0)
    batches = [(torch.randn(4, 4, 8), torch.randn(4, 4, 8)) for _ in range(STEPS)]
    captured = capture_program(_KernelLayout(), batches[0], mse)
    (transpose,) = [
        n for n in captured.program.graph.nodes if n.target is torch.ops.aten.transpose.int
    ]
    assert [u.target for u in transpose.users] == [torch.ops.aten.reshape.default]
    assert_trains_like_one_device(_KernelLayout(), mse, sgd, batches, DP_TP)


def test_reentrant_checkpoint_keeps_its_gradients() -> None:
    """Traced as export sees it, a reentrant checkpoint's function runs under no_grad:
    capture calls it directly, with gradients, except where no input needs one (then one
    device trains nothing inside it either, and neither does the plan)."""
    torch.manual_seed(0)
    batch = _regression(1)[0]
    for frozen_first in (False, True):
        captured = capture_program(_Checkpointed(frozen_first), batch, mse)
        no_grad = {
            op.module_path
            for op, node in zip(captured.graph.ops, _op_nodes(captured), strict=True)
            if node.meta.get("plait_grad_enabled") is False
        }
        # frozen: the first block reads the batch, the second the first's output (no
        # gradient either); their activations are called at the top level ("")
        assert no_grad == ({"fc1", "fc2", ""} if frozen_first else set())
    model = _Checkpointed(frozen_first=True)
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad"):
        expected = reference_run(model, mse, sgd, _regression())
    for untrained in ("fc1.weight", "fc2.bias"):
        torch.testing.assert_close(expected.state[untrained], model.state_dict()[untrained])
    actual, _ = _train(model, mse, sgd, _regression(), DP_TP)
    assert_same_run(expected, actual, rtol=1e-4, atol=1e-5)


def _op_nodes(captured: Any) -> list[torch.fx.Node]:
    """The fx node of each op of ``captured.graph``, in op order."""
    by_name = {n.name: n for n in captured.program.graph.nodes}
    node_of = {op: node for node, op in captured.op_of_node.items()}
    return [by_name[node_of[op.name]] for op in captured.graph.ops]


class _Cumulative(nn.Module):
    """``logcumsumexp`` (no rule in the catalogue) reads the batch directly."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.logcumsumexp(x, dim=-1))


def test_op_without_a_rule_reading_a_batch_split_over_a_unit_axis() -> None:
    """On dp=1 x tp=4 the batch is laid out split over dp, an axis of size one: it is the
    whole tensor, so the op without a rule runs on it replicated (this raised "planned inputs
    are not replicated" for Hugging Face GPT-2's label pad before pad had a rule)."""
    torch.manual_seed(0)
    plan = assert_trains_like_one_device(_Cumulative(), mse, sgd, _regression(), {"dp": 1, "tp": 4})
    (op,) = [op for op in plan.ops if not op.covered]
    assert op.target == "aten.logcumsumexp.default"
    assert "replicated: no rule (1 op)" in plan.summary()


# --------------------------------------------------------------------------- the pad rule


class _Padded(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.pad(x, (0, 0, 1, 2), value=-1.0)


@pytest.mark.parametrize("mode", ["constant", "reflect"])
def test_pad_rule_keeps_padded_dims_whole(mode: str) -> None:
    graph = capture_program(_Padded(), torch.randn(4, 6, 8)).graph
    (op,) = graph.ops
    if mode == "reflect":  # DTensor has no strategy for it: replicated only
        op = dataclasses.replace(op, args=(*op.args[:2], "reflect"))
    mesh = plait.MeshSpec(("dp", "tp"), (2, 2))
    strategies = default_catalogue().strategies(op, mesh)
    assert all(s.inputs[0].dims[1] == () == s.outputs[0].dims[1] for s in strategies)
    split = {a for s in strategies for d in (0, 2) for a in s.inputs[0].dims[d]}
    assert split == ({"dp", "tp"} if mode == "constant" else set())


# --------------------------------------------------------------------------- refused


class _BooleanMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x[x[:, 0] > 0]).sum()


class _ValueBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if h.sum() > 0:
            return h.sum()
        return -h.sum()


class _Outer(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.block = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


@pytest.mark.parametrize(
    ("inner", "line"),
    [(_BooleanMask, "x[x[:, 0] > 0]"), (_ValueBranch, "if h.sum() > 0:")],
    ids=["boolean-mask", "branch"],
)
def test_value_dependent_shapes_are_refused_naming_the_module(
    inner: type[nn.Module], line: str
) -> None:
    with pytest.raises(CaptureError) as info:
        capture_program(_Outer(inner()), torch.randn(4, 8), lambda m, b: m(b))
    message = str(info.value)
    assert f"module 'block' ({inner.__name__})" in message
    assert line in message
    assert "torch.where" in message and "mode='data_parallel'" in message


class _Loop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch._higher_order_ops.while_loop import while_loop

        def body(i: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return i + 1, t * 2

        _, out = while_loop(lambda i, t: i < 3, body, (torch.tensor(0), self.fc(x)))
        return out.sum()


def test_other_higher_order_ops_are_refused_by_name() -> None:
    with pytest.raises(CaptureError, match=r"module 'block' calls while_loop.*Python loop"):
        capture_program(_Outer(_Loop()), torch.randn(4, 8), lambda m, b: m(b))


@pytest.mark.parametrize(
    ("arch", "module", "line"),
    [
        ("mixtral", "model.layers.0.block_sparse_moe", "for expert_idx in expert_hit"),
        ("bart", "model.encoder", "if dropout_probability < self.layerdrop"),
    ],
)
def test_hf_value_dependent_models_are_refused(arch: str, module: str, line: str) -> None:
    """Mixtral's experts looped over by value (transformers 4.x; 5.x with
    ``experts_implementation="eager"``); BART's layer drop branching on torch.rand (4.x
    always; 5.x with a layer drop above 0)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if arch == "mixtral":
        fields = dict(HF["mixtral"].fields)
        if transformers_major() >= 5:
            fields["experts_implementation"] = "eager"
            module = "model.layers.0.mlp.experts"  # the loop moved into the experts module
        config = transformers.MixtralConfig(**fields)
        model, batch = transformers.MixtralForCausalLM(config), _causal_lm()
    else:
        config = transformers.BartConfig(**_BART, encoder_layerdrop=0.1)
        model, batch = transformers.BartForConditionalGeneration(config), _seq2seq()
    with pytest.raises(CaptureError) as info:
        capture_program(model, batch, own_loss)
    assert f"module {module!r}" in str(info.value) and line in str(info.value)


class _Fills(nn.Module):
    """``fill_`` with a computed value and ``copy_`` into a fresh tensor, as forwards write."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        level = torch.zeros_like(h)
        level.fill_(h.mean())  # torch 2.13's DTensor has no strategy for fill_.Tensor
        doubled = torch.empty_like(h)
        doubled.copy_(h * 2)  # in place on a fresh tensor, an op without a rule
        return self.b(h + level + doubled)


@pytest.mark.parametrize(
    ("mesh", "search"), [(DP_TP, "sharding_propagation"), (TP, "dynamic_programming")]
)
def test_fill_with_a_tensor_and_copy_into_a_fresh_tensor_train_like_one_device(
    mesh: dict, search: str
) -> None:
    """Both crashed at run time (DTensor's missing strategy; autograd refusing an in-place op
    on a local view): capture writes the fill as the copy it equals, and an in-place op
    without a rule runs on a copy of its input."""
    torch.manual_seed(0)
    plan = assert_trains_like_one_device(_Fills(), mse, sgd, _regression(), mesh, search)
    assert "aten.fill_.Tensor" not in {op.target for op in plan.ops}
