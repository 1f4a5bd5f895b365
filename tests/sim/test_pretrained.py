"""Pretrained weights into sharded jobs (plait/runtime/engine/pretrained.py) and meta init.

A model built under ``torch.device("meta")`` is parallelized without values (each rank's
pieces created empty), filled from a safetensors file or a Hugging Face directory with each
(simulated) rank reading only its own slice, then trains exactly as single-device training
from the same weights. Bad inputs are refused by name with nothing loaded.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

import plait
from plait import ParallelConfig
from plait._compat import rank_pieces, simulated_ranks
from plait.comm.dtensor import build_device_mesh, distribute
from plait.layout import TensorLayout
from plait.mesh import MeshSpec
from plait.models import MLP, GPTConfig, TinyGPT, annotate_megatron, gpt_loss, mlp_loss
from plait.models.gpt import Attention
from plait.runtime.engine import pretrained
from plait.runtime.engine.meta_init import is_uninitialised, require_initialised
from plait.testing import simulate
from plait.testing.equivalence import assert_same_run, parallel_steps, reference_run

CFG = GPTConfig(vocab=32, seq=8, width=16, heads=4, layers=1)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def _batches(n: int, vocab: int = CFG.vocab, seq: int = CFG.seq):
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (8, seq), generator=gen)
        out.append((ids, torch.roll(ids, -1, dims=1)))
    return out


def _meta_gpt() -> TinyGPT:
    """TinyGPT with no values; its causal mask (not in state_dict) made real again."""
    with torch.device("meta"):
        model = TinyGPT(CFG)
    for module in model.modules():
        if isinstance(module, Attention):
            mask = torch.full((CFG.seq, CFG.seq), float("-inf")).triu(1)
            module.register_buffer("mask", mask, persistent=False)
    return model


@pytest.fixture
def saved_gpt(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    path = tmp_path / "tiny.safetensors"
    save_file(model.state_dict(), str(path))
    return model, path


class _Reads:
    """Records every slice the loader reads: (tensor name, shape read)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.shapes: list[tuple[str, tuple[int, ...]]] = []
        read = pretrained._Reader.read

        def recording(reader, source, where):
            value = read(reader, source, where)
            self.shapes.append((source.name, tuple(value.shape)))
            return value

        monkeypatch.setattr(pretrained._Reader, "read", recording)


def test_meta_gpt_loaded_into_dp2_tp2_trains_like_single_device(saved_gpt, monkeypatch):
    """The issue's case: weights saved from a TinyGPT, a meta copy laid out dp=2 x tp=2
    (Megatron), each rank reading its own slices; then SGD equals single-device training."""
    model, path = saved_gpt
    batches = _batches(2)
    expected = reference_run(model, gpt_loss, _sgd, batches)
    meta = annotate_megatron(_meta_gpt(), 2)
    reads = _Reads(monkeypatch)
    with simulate(4):
        job = plait.parallelize(
            meta,
            ParallelConfig(mode="semi_auto", mesh={"dp": 2, "tp": 2}),
            optimizer=_sgd,
            loss_fn=gpt_loss,
            example_batch=batches[0],
        )
        assert is_uninitialised(job.model)
        with pytest.raises(plait.CheckpointError, match="load_pretrained"):
            require_initialised(job.model)
        names = job.load_pretrained(path)
        assert not is_uninitialised(job.model)
        run = parallel_steps(job, batches)
    assert names == list(model.state_dict())
    assert_same_run(expected, run)
    # Column-parallel fc1 is split over tp: each read is half of it, one per tp coordinate
    # (the two dp ranks holding the same piece share one read).
    fc1 = [shape for name, shape in reads.shapes if name == "blocks.0.fc1.weight"]
    assert fc1 == [(2 * CFG.width, CFG.width)] * 2


def test_meta_mlp_plain_data_parallel_and_optimizer_shard(tmp_path):
    """Plain data parallel (each rank the whole model, materialised empty on its device) and
    optimizer parallel level 2 (its shards are copies of the parameters, refreshed after the
    load), from a meta model."""
    torch.manual_seed(0)
    model = MLP((16, 32, 8))
    path = tmp_path / "mlp.safetensors"
    save_file(model.state_dict(), str(path))
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 16, generator=gen), torch.randn(8, 8, generator=gen))] * 2
    expected = reference_run(model, mlp_loss, _sgd, batches)
    for config in (
        ParallelConfig(mode="data_parallel"),
        ParallelConfig(mode="data_parallel", optimizer_shard=2, optimizer_shard_threshold=0),
    ):
        with torch.device("meta"):
            meta = MLP((16, 32, 8))
        with simulate(2):
            job = plait.parallelize(
                meta, config, optimizer=_sgd, loss_fn=mlp_loss, example_batch=batches[0]
            )
            job.load_pretrained(path)
            run = parallel_steps(job, batches)
        assert_same_run(expected, run)


@pytest.mark.parametrize(
    "dims",
    [(("tp", "dp"), ()), ((), ("tp", "dp")), (("dp",), ("tp",))],
    ids=["strided_dim0", "strided_dim1", "two_dims"],
)
def test_each_rank_slice_is_its_piece(dims):
    """DTensor's offsets (strided shards included: a dim split over tp then dp, against mesh
    order) name exactly the piece plait's placement gives each rank."""
    mesh = MeshSpec(("dp", "tp"), (2, 2))
    full = torch.arange(8 * 12).reshape(8, 12)
    with simulate(4):
        device_mesh = build_device_mesh(mesh)
        placed = distribute(full, device_mesh, TensorLayout(mesh, dims))
        ranks = simulated_ranks()
        assert ranks is not None
        pieces = rank_pieces(placed.to_local(), ranks)
        coordinates = pretrained._coordinates(device_mesh)
        for r in ranks:
            where = pretrained._piece_slices(placed, coordinates[r])
            assert torch.equal(pieces[r], full[where]), (r, where)


def _hf_gpt2(meta: bool = False):
    transformers = pytest.importorskip("transformers")
    conf = transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    if not meta:
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(conf)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(conf)
    for block in model.transformer.h:  # its non-persistent buffers: not in any file
        causal = torch.ones(16, 16, dtype=torch.bool).tril().view(1, 1, 16, 16)
        block.attn.register_buffer("bias", causal, persistent=False)
        block.attn.register_buffer("masked_bias", torch.tensor(-1e4), persistent=False)
    return model


def _hf_batches(n: int):
    gen = torch.Generator().manual_seed(1)
    # A prepared 4-D causal mask: the model's own mask building does not export (vmap).
    mask = torch.ones(16, 16, dtype=torch.bool).tril().expand(4, 1, 16, 16)
    return [
        {"input_ids": ids, "labels": ids, "attention_mask": mask, "use_cache": False}
        for ids in (torch.randint(0, 64, (4, 16), generator=gen) for _ in range(n))
    ]


def _hf_loss(model, batch):
    return model(**batch).loss


def test_hugging_face_gpt2_with_tied_head_from_save_pretrained(tmp_path):
    """save_pretrained writes the tied lm_head once (under the embedding's name); a meta
    GPT-2 laid out on dp=2 x tp=2 loads it, stays tied, and trains like one device."""
    source = _hf_gpt2()
    source.save_pretrained(tmp_path)
    batches = _hf_batches(1)
    expected = reference_run(source, _hf_loss, _sgd, batches)
    model = _hf_gpt2(meta=True)
    with simulate(4):
        job = plait.parallelize(
            model,
            ParallelConfig(mode="semi_auto", mesh={"dp": 2, "tp": 2}),
            optimizer=_sgd,
            loss_fn=_hf_loss,
            example_batch=batches[0],
        )
        names = job.load_pretrained(tmp_path)
        assert "lm_head.weight" in names
        assert job.model.lm_head.weight is job.model.transformer.wte.weight
        run = parallel_steps(job, batches)
    assert_same_run(expected, run)


def test_sharded_hugging_face_directory_and_base_model_prefix(tmp_path):
    """A directory of several files with model.safetensors.index.json; and a base model's
    weights (names without 'transformer.') into the model with a head."""
    source = _hf_gpt2()
    source.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    index = json.loads((tmp_path / "sharded" / pretrained.INDEX).read_text())
    assert len(set(index["weight_map"].values())) > 1
    job = plait.parallelize(
        _hf_gpt2(meta=True), ParallelConfig(mode="stand_alone"), optimizer=_sgd, loss_fn=_hf_loss
    )
    job.load_pretrained(tmp_path / "sharded")
    for name, value in source.state_dict().items():
        assert torch.equal(job.model.state_dict()[name], value), name

    source.transformer.save_pretrained(tmp_path / "base")  # GPT2Model: no prefix, no head
    other = plait.parallelize(
        _hf_gpt2(), ParallelConfig(mode="stand_alone"), optimizer=_sgd, loss_fn=_hf_loss
    )
    other.load_pretrained(tmp_path / "base" / "model.safetensors")
    assert torch.equal(other.model.lm_head.weight, source.lm_head.weight)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda s: s.pop("blocks.0.fc1.bias"), r"missing from the files: 'blocks\.0\.fc1\.bias'"),
        (lambda s: s.update(extra=torch.zeros(2)), r"not in the model: 'extra'"),
        (
            lambda s: s.update({"head.weight": torch.zeros(CFG.vocab + 1, CFG.width)}),
            r"shapes differ: 'head\.weight' \(file \[33, 16\], model \[32, 16\]\)",
        ),
        (
            lambda s: s.update({"ln.weight": torch.ones(CFG.width, dtype=torch.int64)}),
            r"another kind .*'ln\.weight' \(file I64, model torch\.float32\)",
        ),
    ],
    ids=["missing", "unexpected", "shape", "dtype"],
)
def test_bad_weights_are_refused_by_name_with_nothing_loaded(tmp_path, change, message):
    state = {k: v + 1 for k, v in TinyGPT(CFG).state_dict().items()}
    change(state)
    path = tmp_path / "bad.safetensors"
    save_file(state, str(path))
    job = plait.parallelize(
        TinyGPT(CFG), ParallelConfig(mode="stand_alone"), optimizer=_sgd, loss_fn=gpt_loss
    )
    before = {k: v.clone() for k, v in job.model.state_dict().items()}
    with pytest.raises(plait.CheckpointError, match=message) as error:
        job.load_pretrained(path)
    assert "bad.safetensors" in str(error.value) and "nothing was loaded" in str(error.value)
    for k, v in job.model.state_dict().items():
        assert torch.equal(v, before[k]), k  # untouched


def test_missing_or_foreign_files_are_refused(tmp_path):
    job = plait.parallelize(
        _meta_gpt(), ParallelConfig(mode="stand_alone"), optimizer=_sgd, loss_fn=gpt_loss
    )
    with pytest.raises(plait.CheckpointError, match="do not exist"):
        job.load_pretrained(tmp_path / "nowhere.safetensors")
    with pytest.raises(plait.CheckpointError, match=r"neither model\.safetensors"):
        job.load_pretrained(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    with pytest.raises(plait.CheckpointError, match=r"not a \.safetensors file"):
        job.load_pretrained(tmp_path / "weights.bin")
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 16)
    with pytest.raises(plait.CheckpointError, match="not a readable safetensors"):
        job.load_pretrained(tmp_path)
    index = {"weight_map": {"tok.weight": "gone.safetensors"}}
    (tmp_path / pretrained.INDEX).write_text(json.dumps(index))
    with pytest.raises(plait.CheckpointError, match=r"gone\.safetensors"):
        job.load_pretrained(tmp_path)
    assert is_uninitialised(job.model)  # still: nothing was loaded


def test_meta_non_persistent_buffer_is_refused_at_parallelize():
    with torch.device("meta"):
        model = TinyGPT(CFG)
    with pytest.raises(plait.CheckpointError, match=r"'blocks\.0\.attn\.mask' is on the meta"):
        plait.parallelize(
            model, ParallelConfig(mode="stand_alone"), optimizer=_sgd, loss_fn=gpt_loss
        )


def test_deferred_job_loads_whole_before_planning_and_refuses_meta(saved_gpt):
    """Planned at the first step: a real model is loaded whole now (placement slices it at
    the first step); a meta one has nothing to load into until then: refused, with the fix."""
    model, path = saved_gpt
    torch.manual_seed(5)
    config = ParallelConfig(mode="semi_auto", mesh={"dp": 2, "tp": 2})
    with simulate(4):
        meta = plait.parallelize(
            annotate_megatron(_meta_gpt(), 2), config, optimizer=_sgd, loss_fn=gpt_loss
        )
        with pytest.raises(plait.CheckpointError, match="example_batch="):
            meta.load_pretrained(path)
        job = plait.parallelize(TinyGPT(CFG), config, optimizer=_sgd, loss_fn=gpt_loss)
        job.load_pretrained(path)
        assert job.built is None
        state = job.full_state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(state[name], value), name


def test_step_and_evaluate_refuse_before_load_then_evaluate_runs(saved_gpt, caplog):
    model, path = saved_gpt
    batches = _batches(1)
    with simulate(4):
        job = plait.parallelize(
            annotate_megatron(_meta_gpt(), 2),
            ParallelConfig(mode="semi_auto", mesh={"dp": 2, "tp": 2}),
            optimizer=_sgd,
            loss_fn=gpt_loss,
            example_batch=batches[0],
        )
        with pytest.raises(plait.CheckpointError, match=r"job\.load_pretrained"):
            job.step(batches[0])
        with pytest.raises(plait.CheckpointError, match=r"job\.evaluate"):
            job.evaluate(batches[0])
        job.load_pretrained(path)
        got = job.evaluate(batches[0])
    assert "no evaluation program" not in caplog.text
    with torch.no_grad():
        want = gpt_loss(model, batches[0]).item()
    assert got == pytest.approx(want, rel=1e-5)
    for cfg in (ParallelConfig(mode="data_parallel"), ParallelConfig(mode="stand_alone")):
        with simulate(2):
            job = plait.parallelize(_meta_gpt(), cfg, optimizer=_sgd, loss_fn=gpt_loss)
            with pytest.raises(plait.CheckpointError, match="uninitialised"):
                job.step(batches[0])
