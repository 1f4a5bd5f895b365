"""Host and device heterogeneous training (``host_modules``, ``plait.on_host``).

On this CPU-only machine the host is the device, so the copies are no-ops: these tests check
the numerics (training equals one device), the placement decisions (which parameters live on
the host, their buckets), the collectives and the refusals. The memory effect is measured on a
GPU by ``bench/gpu_memory.py`` (case ``host-emb``).
"""

import copy

import pytest
import torch
from torch import nn

import plait
from plait import ConfigError, NotBuiltError, ParallelConfig
from plait.models import GPTConfig, TinyGPT, gpt_loss
from plait.runtime.engine.host import host_module_paths, plan_host_placement
from plait.runtime.program.grad_sync import _same_device_runs
from plait.testing.comm import CollectiveLog
from plait.testing.equivalence import Run, assert_same_run, reference_run
from tests.sim.conftest import adamw


def _train(model, config, batches, world=2):
    with plait.testing.simulate(world):
        job = plait.parallelize(model, config, optimizer=adamw, loss_fn=gpt_loss)
        with CollectiveLog(job.device_mesh) as log:
            losses = [job.step(b) for b in batches]
        state = job.full_state_dict()
        devices = {n: p.device for n, p in job.model.named_parameters()}
        buckets = [[p.shape for p in b.params] for b in job.grad_sync.buckets]
    return Run(losses, state), log, devices, buckets


def test_embedding_on_the_host_trains_like_one_device(gpt_and_batches):
    """AdamW, fp32: the token table's unused rows get exactly zero gradient on every rank
    (no rounding noise for Adam to amplify), so the default tight tolerance holds."""
    model, batches = gpt_and_batches
    expected = reference_run(model, gpt_loss, adamw, batches[:4])
    got, log, devices, buckets = _train(
        copy.deepcopy(model), ParallelConfig(host_modules=("tok",)), batches[:4]
    )
    assert_same_run(expected, got)
    assert devices["tok.weight"] == torch.device("cpu")
    # one bucket (everything fits 25 MB), the loss: per step, as without host modules
    assert log.counts() == {("all_reduce", "dp"): 4 * 2}
    assert sum(len(b) for b in buckets) == len(list(model.parameters()))


def test_on_host_mark_is_the_same_as_the_config(gpt_and_batches):
    model, batches = gpt_and_batches
    by_config, *_ = _train(copy.deepcopy(model), ParallelConfig(host_modules=("tok",)), batches[:2])
    marked = copy.deepcopy(model)
    plait.on_host(marked.tok)
    assert plait.annotate.host_marks(marked) == ("tok",)
    by_mark, *_ = _train(marked, ParallelConfig(), batches[:2])
    assert by_mark.losses == by_config.losses
    for k, v in by_config.state.items():
        assert torch.equal(by_mark.state[k], v), k


def test_placement_keeps_outermost_modules_and_counts_bytes():
    model = TinyGPT(GPTConfig(vocab=64, seq=8, width=16, heads=4, layers=2))
    cfg = ParallelConfig(host_modules=("blocks.0", "blocks.0.attn", "tok"))
    paths = host_module_paths(model, cfg)
    assert paths == ("blocks.0", "tok")
    placement = plan_host_placement(model, paths)
    block = sum(p.numel() for p in model.blocks[0].parameters())
    assert placement.parameter_bytes == 4 * (block + 64 * 16)
    assert "tok.weight" in placement.parameters
    assert all(n.startswith(("blocks.0.", "tok.")) for n in placement.parameters)


def test_buckets_never_mix_devices():
    params = [nn.Parameter(torch.zeros(2, device=d)) for d in ("cpu", "cpu", "meta", "cpu")]
    runs = _same_device_runs(params)
    assert [[p.device.type for p in r] for r in runs] == [["cpu", "cpu"], ["meta"], ["cpu"]]


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.out = nn.Linear(4, 10, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, ids):
        return self.out(self.emb(ids))


def test_tied_weights_across_host_and_device_are_refused():
    model = _Tied()
    with pytest.raises(ConfigError, match=r"emb\.weight is also out\.weight.*tied weights"):
        plan_host_placement(model, host_module_paths(model, ParallelConfig(host_modules=("emb",))))
    # both on the host: allowed
    both = plan_host_placement(model, ("emb", "out"))
    assert both.parameters == ("emb.weight",)


def test_unknown_module_is_refused_with_a_suggestion():
    model = TinyGPT(GPTConfig(vocab=32, seq=8, width=16, heads=4, layers=1))
    with pytest.raises(
        ConfigError, match=r"'tokk', which is not a module of TinyGPT \(did you mean 'tok'"
    ):
        host_module_paths(model, ParallelConfig(host_modules=("tokk",)))
    plait.on_host(model)  # the root module itself
    with plait.testing.simulate(2), pytest.raises(ConfigError, match="is the whole model"):
        plait.parallelize(model, ParallelConfig(), optimizer=adamw, loss_fn=gpt_loss)


@pytest.mark.parametrize(
    "config",
    [
        ParallelConfig(mode="semi_auto", host_modules=("tok",)),
        ParallelConfig(recompute="full", host_modules=("tok",)),
        ParallelConfig(mode="data_parallel", mesh={"dp": 1, "tp": 2}, host_modules=("tok",)),
    ],
    ids=["semi_auto", "recompute", "tp_mesh"],
)
def test_host_modules_off_the_plain_path_are_refused_by_name(config, gpt_and_batches):
    model, _ = gpt_and_batches
    with plait.testing.simulate(2), pytest.raises(NotBuiltError, match=r"host_modules=\('tok',\)"):
        plait.parallelize(model, config, optimizer=adamw, loss_fn=gpt_loss)


def test_on_host_takes_a_bool():
    with pytest.raises(ConfigError, match="give True or False"):
        plait.on_host(nn.Linear(2, 2), host="yes")


def test_plans_refuse_host_modules_where_runs_do_and_note_them_where_they_run(gpt_and_batches):
    model, batches = gpt_and_batches
    dp = ParallelConfig(mode="data_parallel", devices=2, host_modules=("tok",))
    plan = plait.plan(model, dp, example_batch=batches[0], loss_fn=gpt_loss)
    assert any(n.startswith("host_modules tok: kept and computed on the host") for n in plan.notes)
    semi = ParallelConfig(mode="semi_auto", devices=2, host_modules=("tok",))
    with pytest.raises(NotBuiltError, match=r"host_modules=\('tok',\)\) with mode='semi_auto'"):
        plait.plan(model, semi, example_batch=batches[0], loss_fn=gpt_loss)


def test_host_modules_are_never_made_or_put_on_the_device():
    """Meta init makes a host module's tensors in host memory, and the move to the device
    leaves them there (a table larger than the device never visits it). The "device" here
    is meta, the one other device a CPU machine has: what lands there was moved."""
    from plait.runtime.engine.meta_init import materialize_meta, move_to_device

    def build() -> nn.Module:  # "0": the embedding table kept on the host
        return nn.Sequential(nn.Embedding(64, 16), nn.LayerNorm(16), nn.Linear(16, 64))

    with torch.device("meta"):
        built_on_meta = build()
    assert materialize_meta(built_on_meta, "meta", ("0",))
    devices = {n: p.device.type for n, p in built_on_meta.named_parameters()}
    assert devices == {
        "0.weight": "cpu",
        "1.weight": "meta",
        "1.bias": "meta",
        "2.weight": "meta",
        "2.bias": "meta",
    }

    on_cpu = build()
    move_to_device(on_cpu, torch.device("meta"), keep=("0",))
    assert {n: p.device.type for n, p in on_cpu.named_parameters()} == devices
