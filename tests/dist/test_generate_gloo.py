"""Real processes: generation and the Hugging Face round trip on gloo ranks.

One spawn of 2 processes checks several things: a tiny Llama on tp=2 (Megatron) generates
the tokens its own greedy ``generate`` gives on one device, through ``job.generate`` (the
key/value cache split on heads) and through Hugging Face's own ``job.model.generate``; after
a training step ``job.save_pretrained`` writes a directory that ``from_pretrained`` loads
equal to the trained weights; a tiny GPT-2 on pure data parallel generates one device's tokens too; the
Llama trained on pp=2 (each rank one stage) is saved the same way. The dp=2 x tp=2 case on
4 processes is nightly.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import plait
from plait import ParallelConfig
from plait.annotate import megatron
from plait.testing import run_workers

pytestmark = pytest.mark.dist

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


EXAMPLE = _ids()


def _own_loss(model, batch):
    return model(**batch).loss


def _logits_loss(model, batch):
    """The causal LM loss from the logits (a pipeline's first stage takes the ids alone)."""
    logits = model(input_ids=batch["input_ids"]).logits[:, :-1]
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"][:, 1:].flatten())


def _job(model: torch.nn.Module, config: ParallelConfig, loss_fn=_own_loss):
    return plait.parallelize(
        model,
        config,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        loss_fn=loss_fn,
        example_batch={"input_ids": EXAMPLE, "labels": EXAMPLE},
    )


def _worker(directory: str, mesh: dict[str, int], pipeline: bool) -> dict:
    ids = _ids()
    llama = _llama()
    megatron(llama, mesh["tp"])
    # every rank passes the global batch to step, as to generate
    job = _job(llama, ParallelConfig(mode="semi_auto", mesh=mesh, dataset_strategy="full_batch"))
    out = {
        "generate": job.generate(ids, max_new_tokens=NEW),
        "hf_generate": job.model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW
        ).clone(),
    }
    job.step({"input_ids": ids, "labels": ids})
    out["trained"] = job.full_state_dict()
    job.save_pretrained(directory)
    gpt2 = _job(
        _gpt2(), ParallelConfig(mode="data_parallel", mesh={"dp": math.prod(mesh.values())})
    )
    out["gpt2"] = gpt2.generate(ids, max_new_tokens=NEW)
    if pipeline:
        stages = _job(
            _llama().train(),
            ParallelConfig(
                mode="data_parallel", mesh={"pp": 2}, micro_batches=2,
                dataset_strategy="full_batch",
            ),
            _logits_loss,
        )  # fmt: skip
        stages.step({"input_ids": ids, "labels": ids})
        out["pipeline_trained"] = stages.full_state_dict()
        stages.save_pretrained(directory + "-pipeline", max_shard_bytes=20_000)
    return out


def _check(tmp_path: Path, processes: int, mesh: dict[str, int]) -> None:
    ids = _ids()
    with torch.no_grad():
        llama = _llama().generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW
        )
        gpt2 = _gpt2().generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW
        )
    pipeline = processes == 2
    results = run_workers(_worker, processes, str(tmp_path / "llama"), mesh, pipeline)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "llama").state_dict()
    for result in results:
        assert torch.equal(result["generate"], llama)
        assert torch.equal(result["hf_generate"], llama)
        assert torch.equal(result["gpt2"], gpt2)
        assert set(loaded) == set(result["trained"])
        for name, value in result["trained"].items():
            torch.testing.assert_close(loaded[name], value, rtol=0, atol=0)
    before = _llama().state_dict()
    assert any(not torch.equal(loaded[k], before[k]) for k in before)  # trained, not initial
    if pipeline:  # pp=2: each rank held one stage; several shards and their index
        directory = tmp_path / "llama-pipeline"
        assert (directory / "model.safetensors.index.json").exists()
        staged = transformers.AutoModelForCausalLM.from_pretrained(directory).state_dict()
        trained = results[0]["pipeline_trained"]
        assert set(staged) == set(trained)
        for name, value in trained.items():
            torch.testing.assert_close(staged[name], value, rtol=0, atol=0)
        assert any(not torch.equal(staged[k], before[k]) for k in before)


def test_generate_and_save_pretrained_on_tp2(tmp_path: Path) -> None:
    _check(tmp_path, 2, {"tp": 2})


@pytest.mark.nightly
def test_generate_and_save_pretrained_on_dp2_x_tp2(tmp_path: Path) -> None:
    _check(tmp_path, 4, {"dp": 2, "tp": 2})
