"""``job.generate``, Hugging Face's own ``job.model.generate`` and ``job.save_pretrained`` on
simulated ranks (tiny random Llama and GPT-2; the real-process check is
tests/dist/test_generate_gloo.py).

Checked: greedy tokens equal the model's own greedy generation on one device
(``model.generate(ids, do_sample=False)``: token for token, so exactly equal) on dp x tp
(Megatron) and ZeRO-3; the key/value cache is split on the head dim over tp and the rows over
dp; Hugging Face's own ``generate`` runs on the job's DTensor parameters; ``save_pretrained``
from tp=2 and ZeRO-3 writes what ``from_pretrained`` loads equal to the trained weights (GPT-2's
tied head written once); plait's own model generates equal to a greedy loop on one device;
bad input and padding on a laid-out job are refused by name.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import plait
from plait import ParallelConfig
from plait.annotate import megatron
from plait.errors import ConfigError, NotBuiltError, ShardingError
from plait.models import GPTConfig, TinyGPT, annotate_megatron, gpt_loss

transformers = pytest.importorskip("transformers")

VOCAB, NEW = 64, 5


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


def _gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4
    )
    return transformers.GPT2LMHeadModel(config).eval()


def _ids() -> torch.Tensor:
    return torch.randint(3, VOCAB, (4, 5), generator=torch.Generator().manual_seed(2))


EXAMPLE = _ids()  # made outside a simulated world (a LocalTensor cannot be captured)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def _own_loss(model, batch):
    return model(**batch).loss


def _reference(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW
        )


def _job(model: torch.nn.Module, config: ParallelConfig):
    return plait.parallelize(
        model,
        config,
        optimizer=_sgd,
        loss_fn=_own_loss,
        example_batch={"input_ids": EXAMPLE, "labels": EXAMPLE},
    )


def test_llama_generates_on_dp_x_tp_with_the_cache_split_on_heads_and_rows() -> None:
    """Megatron tp=2 x dp=2: job.generate and HF's own generate equal one device's greedy
    tokens; the cache holds keys split on the head dim over tp and on the rows over dp."""
    from plait.runtime.engine import generate as gen

    model, ids = _llama(), _ids()
    expected = _reference(model, ids)
    seen: list[object] = []
    first_keys = gen._first_keys

    def spy(layer, initialise, keys, values):
        first_keys(layer, initialise, keys, values)
        seen.append(layer.keys)

    with plait.testing.simulate(world_size=4):
        job = _job(_annotated(model), ParallelConfig(mode="semi_auto", mesh={"dp": 2, "tp": 2}))
        gen._first_keys = spy  # type: ignore[assignment]
        try:
            out = job.generate(ids, max_new_tokens=NEW)
        finally:
            gen._first_keys = first_keys  # type: ignore[assignment]
        hf = job.model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW
        )
    assert torch.equal(out, expected)
    assert torch.equal(hf, expected)
    copied = copy.deepcopy(job.model)
    assert copied.generate.__self__ is copied  # the wrapper follows a copy of the model
    assert len(seen) == 2  # one per layer
    keys = seen[0]
    assert [str(p) for p in keys.placements] == ["S(0)", "S(1)"]  # rows over dp, heads over tp
    assert tuple(keys.to_local().shape[:2]) == (2, 1)  # 2 of 4 rows, 1 of 2 key/value heads


def _annotated(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` with Megatron tensor parallel annotations for tp=2."""
    copied = copy.deepcopy(model)
    megatron(copied, 2)
    return copied


def test_gpt2_generates_under_zero3_and_saves_a_model_from_pretrained_loads(tmp_path: Path) -> None:
    """ZeRO-3 over dp=4: greedy tokens equal one device's; save_pretrained after a training
    step writes the trained weights, the tied head once, and from_pretrained loads them."""
    model, ids = _gpt2(), _ids()
    expected = _reference(model, ids)
    with plait.testing.simulate(world_size=4):
        job = _job(
            copy.deepcopy(model),
            ParallelConfig(mode="data_parallel", mesh={"dp": 4}, optimizer_shard=3),
        )
        out = job.generate(ids, max_new_tokens=NEW)
        job.step({"input_ids": ids, "labels": ids})
        trained = job.full_state_dict()
        job.save_pretrained(tmp_path / "gpt2", max_shard_bytes=40_000)
    assert torch.equal(out, expected)
    files = sorted(p.name for p in (tmp_path / "gpt2").iterdir())
    assert "model.safetensors.index.json" in files and "config.json" in files
    assert "generation_config.json" in files
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "gpt2")
    assert type(loaded) is type(model)
    state = loaded.state_dict()
    for name, value in trained.items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=0)
    assert not torch.equal(trained["transformer.wte.weight"], model.transformer.wte.weight)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight  # tied again


@pytest.mark.nightly  # tests/dist/test_generate_gloo.py runs it on real processes
def test_llama_saved_from_tp2_loads_with_from_pretrained(tmp_path: Path) -> None:
    model, ids = _llama(), _ids()
    with plait.testing.simulate(world_size=2):
        job = _job(_annotated(model), ParallelConfig(mode="semi_auto", mesh={"tp": 2}))
        job.step({"input_ids": ids, "labels": ids})
        trained = job.full_state_dict()
        job.save_pretrained(tmp_path / "llama")
    assert (tmp_path / "llama" / "model.safetensors").exists()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "llama")
    state = loaded.state_dict()
    assert set(state) == set(trained)
    for name, value in trained.items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=0)


def test_plait_model_generates_like_a_greedy_loop_on_one_device(tmp_path: Path) -> None:
    """TinyGPT (no cache: the whole sequence per step) on Megatron tp=2 x dp=2; its weights
    saved by save_pretrained load back with safetensors."""
    from safetensors.torch import load_file

    spec = GPTConfig(vocab=VOCAB, seq=16, width=32, heads=4, layers=2)
    torch.manual_seed(0)
    model = TinyGPT(spec).eval()
    ids = _ids()
    expected = ids
    with torch.no_grad():
        for _ in range(NEW):
            token = model(expected)[:, -1].argmax(-1)
            expected = torch.cat([expected, token[:, None]], dim=1)
    with plait.testing.simulate(world_size=4):
        job = plait.parallelize(
            annotate_megatron(copy.deepcopy(model), 2),
            ParallelConfig(mode="semi_auto", mesh={"dp": 2, "tp": 2}),
            optimizer=_sgd,
            loss_fn=gpt_loss,
            example_batch=(ids, ids),
        )
        out = job.generate(ids, max_new_tokens=NEW)
        job.save_pretrained(tmp_path / "gpt")
    assert torch.equal(out, expected)
    saved = load_file(str(tmp_path / "gpt" / "model.safetensors"))
    for name, value in model.state_dict().items():
        assert torch.equal(saved[name], value), name
    assert not (tmp_path / "gpt" / "config.json").exists()


def test_bad_input_and_padding_are_refused_by_name() -> None:
    model, ids = _llama(), _ids()
    with plait.testing.simulate(world_size=2):
        job = _job(_annotated(model), ParallelConfig(mode="semi_auto", mesh={"tp": 2}))
        with pytest.raises(ShardingError, match=r"input_ids must be the token ids"):
            job.generate(ids[0], max_new_tokens=2)
        with pytest.raises(ConfigError, match=r"max_new_tokens=0\): must be >= 1"):
            job.generate(ids, max_new_tokens=0)
        mask = torch.ones_like(ids)
        mask[1, :2] = 0
        with pytest.raises(NotBuiltError, match=r"padding \(rows \[1\] hold zeros\)"):
            job.generate(ids, max_new_tokens=2, attention_mask=mask)
        with pytest.raises(NotBuiltError, match=r"padding"):
            job.model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=2)


def test_plain_data_parallel_generates_left_padded_prompts() -> None:
    """Plain data parallel holds the whole model: padded prompts (left padding, positions
    from the mask) give Hugging Face's own tokens."""
    model, ids = _llama(), _ids()
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    mask[3, :1] = 0
    with torch.no_grad():
        expected = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW)
    with plait.testing.simulate(world_size=2):
        job = _job(copy.deepcopy(model), ParallelConfig(mode="data_parallel", mesh={"dp": 2}))
        out = job.generate(ids, max_new_tokens=NEW, attention_mask=mask)
    assert torch.equal(out, expected)


def test_pipeline_refusals_are_rows_of_the_support_table() -> None:
    """generate on pipeline stages: refused by name when called, never at parallelize (the
    job's own rules do not include it)."""
    from plait import support

    config = ParallelConfig(mode="data_parallel", mesh={"pp": 2, "dp": 2}, micro_batches=2)
    where = support.Where("pipeline")
    assert support.refusal(config, where, engine_only=True) is None
    with pytest.raises(NotBuiltError, match=r"job\.generate .*on pipeline stages"):
        support.check(config, where, engine_only=True, call="generate")
