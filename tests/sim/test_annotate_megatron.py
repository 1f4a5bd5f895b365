"""``plait.annotate.megatron``: Megatron tensor parallel for models plait did not write.

Hugging Face models from tiny configs (random weights; transformers 4.57.6), called the way
users call them (``model(**batch).loss`` with ``labels=``). Checked:

- the report: Llama's q/k/v/gate/up column parallel, o/down row parallel, the embedding and
  the head split over the vocabulary; GPT-2's Conv1D MLP split with its ``[in, out]`` weight
  transposed, its fused q|k|v reported, not split; BERT's attention found across
  ``attention.self`` and ``attention.output``, its tied decoder bias annotated on both holders;
- ``semi_auto`` on dp=1 x tp=2 (and dp=2 x tp=2, nightly) trains like one device, and the
  program's collectives are Megatron's: one forward all-reduce per row-parallel projection
  and for the vocabulary-parallel embedding, one backward all-reduce per input the column
  parallel projections read (q/k/v share one, gate/up one, the head one), one all-gather of
  the vocabulary-split logits for the loss;
- structures it does not recognise are listed with a reason and left unannotated;
- a tp that does not divide heads, key/value heads, the intermediate size or the vocabulary
  is refused by name, with nothing annotated.

Tolerances: fp32 with SGD (no Adam normalisation, which turns rounding noise in an exactly
zero gradient, such as a key bias's, into lr-sized steps). Tensor parallelism changes only
the order of summation (partial sums all-reduced), a few ulps per op over 3 steps: rtol 1e-5,
atol 1e-6; a wrong split or a missing reduction is off by O(1).
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn

import plait
from plait import ParallelConfig
from plait.annotate import MegatronReport, get_shard_spec, megatron, parameter_layouts
from plait.errors import ConfigError, ShardingError
from plait.mesh import MeshSpec
from plait.models import GPTConfig, TinyGPT, annotate_megatron
from plait.testing.equivalence import assert_same_run, parallel_steps, reference_run

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH, STEPS = 64, 8, 4, 3
TP2 = {"dp": 1, "tp": 2}
_LLAMA = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
    use_cache=False,  # a training run keeps no key/value cache (see test_use_cache_is_noted)
)
_GPT2 = dict(
    vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=1, n_head=4, use_cache=False,
    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
)  # fmt: skip
_BERT = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    num_attention_heads=4, max_position_embeddings=32,
    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
)  # fmt: skip


def llama(**changes: Any) -> nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**_LLAMA, **changes}))


def gpt2() -> nn.Module:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**_GPT2))


def bert() -> nn.Module:
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(transformers.BertConfig(**_BERT))


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def own_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


def causal_lm_batches() -> list[dict[str, torch.Tensor]]:
    torch.manual_seed(1)
    return [
        {"input_ids": ids, "labels": ids}
        for ids in (torch.randint(0, VOCAB, (BATCH, SEQ)) for _ in range(STEPS))
    ]


def masked_lm_batches() -> list[dict[str, torch.Tensor]]:
    batches = causal_lm_batches()
    for b in batches:
        b["labels"] = b["labels"].clone()
        b["labels"][:, ::2] = -100  # only the "masked" positions are predicted
    return batches


def train_like_one_device(
    model: nn.Module, batches: list[dict[str, torch.Tensor]], mesh: dict[str, int]
) -> tuple[Counter, Counter]:
    """Train in semi_auto and against one device; the program's collectives by (kind, axis)
    and the plan's by (kind, phase)."""
    expected = reference_run(model, own_loss, sgd, batches)
    world = mesh["dp"] * mesh["tp"]
    with plait.testing.simulate(world):
        job = plait.parallelize(
            copy.deepcopy(model),
            ParallelConfig(mode="semi_auto", mesh=mesh),
            optimizer=sgd,
            loss_fn=own_loss,
            example_batch=batches[0],
        )
        program = Counter((c.kind, c.axis) for c in job.program.collectives())
        planned = Counter(
            (c.kind, c.phase) for c in job.loss_fn.plan.collectives if c.axes == ("tp",)
        )
        actual = parallel_steps(job, batches)
    assert_same_run(expected, actual, rtol=1e-5, atol=1e-6)
    return program, planned


def weight_dims(report: MegatronReport, path: str, name: str = "weight") -> tuple:
    (m,) = [m for m in report.matched if m.path == path]
    return m.layouts[name].dims


# --------------------------------------------------------------------------- Llama

LLAMA_ROLES = {
    "model.embed_tokens": ("embedding", "vocab"),
    "model.layers.0.self_attn.q_proj": ("attention q", "column"),
    "model.layers.0.self_attn.k_proj": ("attention k", "column"),
    "model.layers.0.self_attn.v_proj": ("attention v", "column"),
    "model.layers.0.self_attn.o_proj": ("attention out", "row"),
    "model.layers.0.mlp.gate_proj": ("mlp gate", "column"),
    "model.layers.0.mlp.up_proj": ("mlp up", "column"),
    "model.layers.0.mlp.down_proj": ("mlp down", "row"),
    "lm_head": ("head", "column"),
}


def test_llama_report_matches_megatron_roles() -> None:
    model = llama()
    report = megatron(model, 2)
    assert report.roles == LLAMA_ROLES
    assert report.unrecognised == ()
    # nn.Linear weights are [out, in]: column splits dim 0, row dim 1; embedding rows.
    assert weight_dims(report, "model.layers.0.self_attn.q_proj") == (("tp",), ())
    assert weight_dims(report, "model.layers.0.self_attn.o_proj") == ((), ("tp",))
    assert weight_dims(report, "model.embed_tokens") == (("tp",), ())
    spec = get_shard_spec(model.model.layers[0].mlp.down_proj)
    assert spec is not None and spec.parameter_strategy["weight"].dims == ((), ("tp",))
    text = str(report)
    assert "model.layers.0.self_attn.k_proj  attention k    column  weight[tp, -]" in text
    assert "not recognised" not in text


def test_llama_semi_auto_trains_like_one_device_with_megatron_collectives() -> None:
    """dp=1 x tp=2 on 2 simulated ranks: forward all-reduces for the embedding, o_proj and
    down_proj; backward all-reduces of the inputs of q/k/v, gate/up and the head; the logits
    gathered for the loss. Nothing else: attention and MLP run split."""
    model = llama()
    megatron(model, 2)
    program, planned = train_like_one_device(model, causal_lm_batches(), TP2)
    assert program == {("all_reduce", "tp"): 6, ("all_gather", "tp"): 1}
    assert planned == {
        ("all_reduce", "forward"): 3,
        ("all_reduce", "backward"): 3,
        ("all_gather", "forward"): 1,
    }


def test_llama_sequence_parallel_trains_like_one_device() -> None:
    """``sequence_parallel=True`` on dp=1 x tp=2: each of plain tensor parallel's tp
    all-reduces of a value (3 forward, 3 backward) becomes a reduce-scatter and an
    all-gather; the RMSNorms' weights, read on a slice of the sequence, have their gradients
    summed over tp (2 in the layer and the final norm's)."""
    model = llama()
    report = megatron(model, 2, sequence_parallel=True)
    assert report.sequence_parallel == (
        "model.embed_tokens",
        "model.layers.0.self_attn.o_proj",
        "model.layers.0.mlp.down_proj",
    )
    program, planned = train_like_one_device(model, causal_lm_batches(), TP2)
    # the norms' gradient sums run after the program, with the step's other reductions
    assert program == {("reduce_scatter", "tp"): 6, ("all_gather", "tp"): 7}
    assert planned == {
        ("reduce_scatter", "forward"): 3,
        ("reduce_scatter", "backward"): 3,
        ("all_gather", "forward"): 4,
        ("all_gather", "backward"): 3,
        ("all_reduce", "backward"): 3,
    }


@pytest.mark.nightly
def test_llama_dp2_tp2_trains_like_one_device() -> None:
    model = llama()
    megatron(model, 2)
    program, _ = train_like_one_device(model, causal_lm_batches(), {"dp": 2, "tp": 2})
    assert program[("all_reduce", "tp")] == 6 and program[("all_gather", "tp")] == 1
    assert {axis for _, axis in program} == {"dp", "tp"}


def test_use_cache_is_noted() -> None:
    """With a key/value cache, Hugging Face concatenates onto an empty tensor in training,
    which runs whole: the report says so, and says nothing once it is off."""
    assert any("use_cache" in n for n in megatron(llama(use_cache=True), 2).notes)
    assert megatron(llama(), 2).notes == ()


# --------------------------------------------------------------------------- GPT-2, BERT


def test_gpt2_conv1d_mlp_split_fused_attention_reported() -> None:
    """Conv1D's weight is [in, out]: column parallel splits dim 1. The fused q|k|v (c_attn)
    and its output projection are reported, not split; the head shares the embedding's
    weight and layout."""
    model = gpt2()
    report = megatron(model, 2)
    assert report.roles == {
        "transformer.wte": ("embedding", "vocab"),
        "transformer.wpe": ("other embedding (not the vocabulary)", "whole"),
        "transformer.h.0.mlp.c_fc": ("mlp up", "column"),
        "transformer.h.0.mlp.c_proj": ("mlp down", "row"),
        "lm_head": ("head (tied to transformer.wte)", "column"),
    }
    assert weight_dims(report, "transformer.h.0.mlp.c_fc") == ((), ("tp",))
    assert weight_dims(report, "transformer.h.0.mlp.c_proj") == (("tp",), ())
    unrecognised = {u.path: u.reason for u in report.unrecognised}
    assert set(unrecognised) == {"transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj"}
    assert unrecognised["transformer.h.0.attn.c_attn"].startswith("fused q|k|v")
    assert get_shard_spec(model.transformer.h[0].attn.c_attn) is None
    layouts = parameter_layouts(model, MeshSpec(("dp", "tp"), (1, 2)))  # a tie agrees
    assert layouts["transformer.wte.weight"].dims == (("tp",), ())


def test_gpt2_semi_auto_trains_like_one_device() -> None:
    """The MLP's two all-reduces, the embedding's and the head's; attention runs whole."""
    model = gpt2()
    megatron(model, 2)
    program, _ = train_like_one_device(model, causal_lm_batches(), TP2)
    assert program == {("all_reduce", "tp"): 4, ("all_gather", "tp"): 1}


def test_bert_attention_across_modules_and_tied_bias() -> None:
    """q/k/v live in attention.self, the output projection in attention.output, the MLP in
    intermediate and output: matched one level apart. The decoder's bias is also
    ``cls.predictions.bias``: annotated alike on both."""
    report = megatron(bert(), 2)
    layer = "bert.encoder.layer.0"
    roles = report.roles
    assert roles[f"{layer}.attention.self.query"] == ("attention q", "column")
    assert roles[f"{layer}.attention.output.dense"] == ("attention out", "row")
    assert roles[f"{layer}.intermediate.dense"] == ("mlp up", "column")
    assert roles[f"{layer}.output.dense"] == ("mlp down", "row")
    assert roles["cls.predictions.decoder"][1] == "column"
    assert roles["cls.predictions"] == ("holds cls.predictions.decoder.bias (tied)", "tied")
    assert [u.path for u in report.unrecognised] == ["cls.predictions.transform.dense"]


@pytest.mark.nightly
def test_bert_semi_auto_trains_like_one_device() -> None:
    model = bert()
    megatron(model, 2)
    program, _ = train_like_one_device(model, masked_lm_batches(), TP2)
    assert program == {("all_reduce", "tp"): 6, ("all_gather", "tp"): 1}


def test_tinygpt_same_splits_as_its_hand_annotation() -> None:
    """On plait's own TinyGPT the structure gives the splits its hand-written annotation does."""
    found, by_hand = TinyGPT(GPTConfig(layers=2)), TinyGPT(GPTConfig(layers=2))
    megatron(found, 2)
    annotate_megatron(by_hand, 2)
    mesh = MeshSpec(("dp", "tp"), (2, 2))
    a, b = parameter_layouts(found, mesh), parameter_layouts(by_hand, mesh)
    hand_split = {k for k, v in b.items() if any(v.dims)}
    assert hand_split and {k: a[k] for k in hand_split} == {k: b[k] for k in hand_split}


_DECODER = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    num_attention_heads=4, max_position_embeddings=32,
)  # fmt: skip
_T5 = dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4)
_OTHERS = {
    # config class, model class, fields, (column, row, unrecognised) counts of the report
    "phi": ("PhiConfig", "PhiForCausalLM", _DECODER, (5, 2, 0)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", _DECODER, (2, 1, 2)),
    "t5": ("T5Config", "T5ForConditionalGeneration", _T5, (3 * 3 + 2 + 1, 3 + 2, 0)),
}


@pytest.mark.parametrize("arch", sorted(_OTHERS))
def test_other_architectures_report(arch: str) -> None:
    """Phi (q/k/v/dense, fc1/fc2, a biased head), GPT-NeoX (fused, per-head interleaved
    query_key_value: reported), T5 (encoder, decoder and cross attention; a tied head)."""
    config, cls, fields, (column, row, unrecognised) = _OTHERS[arch]
    model = getattr(transformers, cls)(getattr(transformers, config)(**fields))
    report = megatron(model, 2)
    splits = Counter(strategy for _, strategy in report.roles.values())
    assert (splits["column"], splits["row"], len(report.unrecognised)) == (
        column,
        row,
        unrecognised,
    )


# --------------------------------------------------------------------------- not recognised


class FusedAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.num_heads = 4
        self.qkv = nn.Linear(32, 96)
        self.proj = nn.Linear(32, 32)


class NoOutput(nn.Module):
    """A head count, q/k/v, but no output projection."""

    def __init__(self) -> None:
        super().__init__()
        self.head_dim = 8
        self.q, self.k, self.v = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32)


class Odd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fused = FusedAttention()
        self.partial = NoOutput()
        self.conv = nn.Conv2d(3, 8, 3)
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))


def test_unrecognised_structures_are_reported_not_guessed() -> None:
    model = Odd()
    report = megatron(model, 2)
    reasons = {u.path: u.reason for u in report.unrecognised}
    assert set(reasons) == {
        "fused.qkv",
        "fused.proj",
        "partial.q",
        "partial.k",
        "partial.v",
        "conv",
    }
    assert reasons["fused.qkv"].startswith("fused q|k|v")
    assert reasons["partial.k"].startswith("in partial: has a head count but its projections")
    assert "Conv2d holds weight [8, 3, 3, 3]" in reasons["conv"]
    assert report.roles == {"mlp.0": ("mlp up", "column"), "mlp.2": ("mlp down", "row")}
    left = [model.fused.qkv, model.fused.proj, model.partial.q, model.conv]
    assert all(get_shard_spec(m) is None for m in left)
    assert "partial.v" in str(report) and "not recognised" in str(report)


# --------------------------------------------------------------------------- refused


@pytest.mark.parametrize(
    ("tp", "phrases"),
    [
        (3, ["model.layers.0.self_attn (attention) has 4 attention heads", "use tp in [1, 2, 4]"]),
        (4, ["has 2 key/value heads, which tp=4 does not divide", "use tp in [1, 2]"]),
    ],
)
def test_tp_not_dividing_heads_is_refused_by_name(tp: int, phrases: list[str]) -> None:
    model = llama()
    with pytest.raises(ShardingError) as err:
        megatron(model, tp)
    for phrase in phrases:
        assert phrase in str(err.value)
    assert all(get_shard_spec(m) is None for m in model.modules())  # nothing annotated


def test_intermediate_size_and_vocabulary_refused_with_the_fix() -> None:
    with pytest.raises(ShardingError) as err:
        megatron(llama(intermediate_size=66, vocab_size=66), 4)
    text = str(err.value)
    assert "model.layers.0.mlp (mlp) has 66 intermediate size" in text
    assert "model.embed_tokens (embedding) has a vocabulary of 66" in text
    assert "pad_to_multiple_of=4" in text and "vocab_parallel=False" in text


def test_vocab_parallel_off_keeps_embedding_and_head_whole() -> None:
    model = llama(vocab_size=66)
    report = megatron(model, 2, vocab_parallel=False)
    assert report.roles["lm_head"] == ("head", "whole")
    assert (
        get_shard_spec(model.lm_head) is None and get_shard_spec(model.model.embed_tokens) is None
    )


def test_bad_arguments_and_conflicting_annotations() -> None:
    with pytest.raises(ConfigError, match="tp=0"):
        megatron(llama(), 0)
    with pytest.raises(ConfigError, match="axis='None'"):
        megatron(llama(), 2, axis="None")
    model = llama()
    plait.shard(model.lm_head, parameter_strategy={"weight": (1, 2)})
    with pytest.raises(ShardingError, match=r"lm_head\.weight is already annotated \(1, 2\)"):
        megatron(model, 2)
    assert get_shard_spec(model.model.layers[0].mlp.up_proj) is None


def test_named_axis_and_repeat() -> None:
    """The layouts name ``axis``; a second call with the same arguments changes nothing."""
    model = llama()
    first = megatron(model, 2, axis="mp")
    assert megatron(model, 2, axis="mp") == first
    layouts = parameter_layouts(model, MeshSpec(("mp", "dp"), (2, 2)))
    assert layouts["model.layers.0.mlp.up_proj.weight"].dims == (("mp",), ())
