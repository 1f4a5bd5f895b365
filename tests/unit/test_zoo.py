"""plait.models: every built-in model (the zoo) trains a step on CPU and builds on meta without memory."""

import math

import pytest
import torch

from plait.errors import ConfigError
from plait.models import KINDS, ModelSpec, build, parameter_count

SPECS = [
    ModelSpec(kind="gpt"),
    ModelSpec(kind="llama", kv_heads=2),
    ModelSpec(kind="llama", kv_heads=1, tied=True),
    ModelSpec(kind="bert"),
    ModelSpec(kind="mlp", layers=3),
    ModelSpec(kind="cnn"),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.kind}-kv{s.kv_heads}-tied{s.tied}")
def test_one_cpu_training_step_lowers_the_loss(spec):
    torch.manual_seed(0)
    model, batch, loss_fn = build(spec)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    before = loss_fn(model, batch)
    before.backward()
    assert all(p.grad is not None for p in model.parameters())
    opt.step()
    after = loss_fn(model, batch).item()
    assert math.isfinite(before.item()) and math.isfinite(after)
    assert after < before.item()


@pytest.mark.parametrize("kind", KINDS)
def test_builds_on_meta_with_meta_batch(kind):
    with torch.device("meta"):
        model, batch, loss_fn = build(ModelSpec(kind=kind))
        loss = loss_fn(model, batch)
    assert all(p.is_meta for p in model.parameters())
    assert all(t.is_meta for t in batch)
    assert loss.shape == ()


def test_batch_shapes_and_int64_ids():
    spec = ModelSpec(kind="bert", batch=3, seq=8, classes=5)
    _, (ids, segments, labels), _ = build(spec)
    assert ids.shape == segments.shape == (3, 8) and labels.shape == (3,)
    assert ids.dtype == segments.dtype == labels.dtype == torch.int64
    assert int(labels.max()) < 5


def test_llama_grouped_query_heads_and_tied_head():
    with torch.device("meta"):
        model, _, _ = build(ModelSpec(kind="llama", hidden=64, heads=8, kv_heads=2, tied=True))
    attn = model.blocks[0].attn
    assert attn.q.weight.shape == (64, 64) and attn.k.weight.shape == (16, 64)
    assert model.head.weight is model.tok.weight
    names = [n for n, _ in model.named_parameters()]
    assert "head.weight" not in names and "tok.weight" in names


def test_gpt3_175b_builds_on_meta():
    spec = ModelSpec(kind="gpt", layers=96, hidden=12288, heads=96, seq=2048, vocab=50304)
    # 12 * L * D^2 for the blocks plus the embeddings and head: GPT-3's 175B.
    assert parameter_count(spec) == pytest.approx(175.2e9, rel=1e-3)


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"kind": "resnet"}, "unknown model kind"),
        ({"layers": 0}, "layers"),
        ({"hidden": 30, "heads": 4}, "must divide hidden"),
        ({"kind": "llama", "heads": 4, "kv_heads": 3}, "must divide heads"),
        ({"kind": "gpt", "kv_heads": 2}, "no grouped-query"),
        ({"kind": "gpt", "ffn": 10}, r"fixed at 4 \* hidden"),
        ({"kind": "llama", "hidden": 12, "heads": 4}, "even head width"),
        ({"kind": "cnn", "layers": 5, "image": 16}, "halves the image side"),
        ({"batch": True}, "positive int"),
    ],
)
def test_spec_errors_name_field_and_fix(fields, fragment):
    with pytest.raises(ConfigError, match=fragment) as info:
        ModelSpec(**fields)
    assert "ModelSpec." in str(info.value)
