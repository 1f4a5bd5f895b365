"""job.predict: the model's outputs, whole on every rank, equal to one device's, in every mode.

Each case trains one SGD step first (so stale or unsynchronised weights would show), then
predicts a batch and compares with the single-device model after the same step. fp32: the
only differences are the order of sums in split matmuls and reductions (a few ulp of logits of
size ~1), hence rtol 1e-5 / atol 1e-6. The collectives predict issues are counted, so an extra
gather or reduction fails. Pipelines are tested on real processes (tests/dist/test_pipeline_gloo.py).
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch.distributed.tensor.debug import CommDebugMode

import plait
from plait import ParallelConfig
from plait.errors import NotBuiltError, ShardingError
from plait.models import GPTConfig, TinyGPT, annotate_megatron, gpt_loss
from plait.testing.equivalence import reference_run

GPT = GPTConfig(vocab=32, seq=8, width=16, heads=4, layers=1)
MEGATRON = {"dp": 2, "tp": 2}


def _sgd(params):
    return torch.optim.SGD(params, lr=0.5)


def _data() -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, GPT.vocab, (8, GPT.seq), generator=gen)
    prompt = torch.randint(0, GPT.vocab, (8, GPT.seq), generator=gen)
    return (ids, torch.roll(ids, -1, dims=1)), prompt


def _expected(model: torch.nn.Module, batch, inputs: torch.Tensor) -> torch.Tensor:
    """One device: one SGD step on ``batch``, then the eval-mode logits of ``inputs``."""
    trained = copy.deepcopy(model)
    trained.load_state_dict(reference_run(model, gpt_loss, _sgd, [batch]).state)
    with torch.no_grad():
        return trained.eval()(inputs)


def _predict(model, config: ParallelConfig, batch, inputs, world: int = 4):
    with plait.testing.simulate(world_size=world):
        job = plait.parallelize(
            copy.deepcopy(model), config, optimizer=_sgd, loss_fn=gpt_loss, example_batch=batch
        )
        job.step(batch)
        out = job.predict((inputs,))  # a plan's forward is captured and traced here, once
        with CommDebugMode() as comm:  # what a prediction issues: the reused forward's
            again = job.predict((inputs,))
        return out, again, _named(comm.get_comm_counts()), job


def _named(counts) -> dict[str, int]:
    """CommDebugMode's counts by collective name (``all_reduce``...), zeros left out."""
    return {str(op).rsplit(".", 1)[-1]: n for op, n in counts.items() if n}


@pytest.mark.parametrize(
    ("name", "config", "rows", "collectives"),
    [
        # pure data parallel: each rank its slice, one all-gather of the logits
        (
            "data_parallel",
            ParallelConfig(mode="data_parallel", mesh={"dp": 4}),
            8,
            {"all_gather_into_tensor": 1},
        ),
        # 3 rows do not divide over 4 ranks: every rank runs them all, nothing is sent
        ("data_parallel_whole", ParallelConfig(mode="data_parallel", mesh={"dp": 4}), 3, {}),
        ("stand_alone", ParallelConfig(mode="stand_alone"), 8, {}),
    ],
)
def test_plain_jobs_predict_like_one_device(name, config, rows, collectives) -> None:
    torch.manual_seed(0)
    model = TinyGPT(GPT)
    batch, prompt = _data()
    world = 1 if config.mode == "stand_alone" else 4
    out, again, counts, _ = _predict(model, config, batch, prompt[:rows], world)
    expected = _expected(model, batch, prompt[:rows])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(out, again)
    assert counts == collectives, name


# plan collective kinds -> the functional collectives CommDebugMode counts
_FUNCOL = {
    "all_reduce": "all_reduce",
    "all_gather": "all_gather_into_tensor",
    "reduce_scatter": "reduce_scatter_tensor",
    "all_to_all": "all_to_all_single",
}


@pytest.mark.parametrize("mode", ["semi_auto", "auto"])
def test_megatron_plan_predicts_like_one_device_with_the_forwards_collectives(mode) -> None:
    """dp=2 x tp=2, Megatron annotations (mode auto plans the ops around them): the logits
    equal one device's. The collectives are exactly the training plan's forward ones at the
    ops prediction runs (the loss's count and value reductions are not run) and one gather of
    the logits (split over dp by rows): no gradient or parameter traffic, nothing extra."""
    torch.manual_seed(0)
    model = annotate_megatron(TinyGPT(GPT), 2)
    batch, prompt = _data()
    config = ParallelConfig(mode=mode, mesh=MEGATRON)
    out, again, counts, job = _predict(model, config, batch, prompt)
    torch.testing.assert_close(out, _expected(model, batch, prompt), rtol=1e-5, atol=1e-6)
    assert torch.equal(out, again)
    (predictor,) = job.loss_fn.predictors.values()
    # it ran as a per-rank program (the one traced for this shape: asked again, not traced)
    program = job.program_for_evaluation(predictor)
    assert program.trained == () and [s.placements is not None for s in program.outputs] == [True]
    runs = {op.name for op in predictor.plan.ops}
    expected = Counter(
        {"all_gather_into_tensor": 1}  # the logits, from their dp rows
    )
    for c in job.loss_fn.plan.collectives:
        if c.phase == "forward" and c.op in runs:
            expected[_FUNCOL[c.kind]] += c.count
    assert counts == dict(expected)
    if mode == "semi_auto":  # Megatron: one tp all-reduce after each row-parallel linear
        assert counts == {"all_reduce": 2, "all_gather_into_tensor": 1}


def test_a_batch_of_another_shape_captures_again_and_rows_that_do_not_divide_run_whole() -> None:
    torch.manual_seed(0)
    model = annotate_megatron(TinyGPT(GPT), 2)
    batch, prompt = _data()
    with plait.testing.simulate(world_size=4):
        job = plait.parallelize(
            copy.deepcopy(model),
            ParallelConfig(mode="semi_auto", mesh=MEGATRON),
            optimizer=_sgd,
            loss_fn=gpt_loss,
            example_batch=batch,
        )
        three = job.predict((prompt[:3],))  # 3 rows: not split over dp=2
        four = job.predict((prompt[:4, :5],))  # a shorter sequence
        assert len(job.loss_fn.predictors) == 2
    with torch.no_grad():
        model.eval()
        torch.testing.assert_close(three, model(prompt[:3]), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(four, model(prompt[:4, :5]), rtol=1e-5, atol=1e-6)


def test_hugging_face_model_output_under_a_plan_and_data_parallel() -> None:
    """``model(**batch)`` as the model card calls it: the ModelOutput comes back with its
    fields (no key/value cache: generation state), logits and the labels' loss equal one
    device's."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(2))
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=ids, labels=ids)
    for config in (
        ParallelConfig(mode="auto", mesh=MEGATRON),
        ParallelConfig(mode="data_parallel", mesh={"dp": 4}),
    ):
        with plait.testing.simulate(world_size=4):
            job = plait.parallelize(
                copy.deepcopy(model),
                config,
                optimizer=_sgd,
                loss_fn=lambda m, b: m(**b).loss,
                example_batch={"input_ids": ids, "labels": ids},
            )
            out = job.predict({"input_ids": ids, "labels": ids})
        assert type(out) is type(expected)
        assert list(out.keys()) == ["loss", "logits"], config.mode
        torch.testing.assert_close(out.logits, expected.logits, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out.loss, expected.loss, rtol=1e-5, atol=1e-6)


def test_bad_input_is_refused_by_name() -> None:
    torch.manual_seed(0)
    batch, _ = _data()
    with plait.testing.simulate(world_size=4):
        lazy = plait.parallelize(
            annotate_megatron(TinyGPT(GPT), 2),
            ParallelConfig(mode="semi_auto", mesh=MEGATRON),
            optimizer=_sgd,
            loss_fn=gpt_loss,
        )
        with pytest.raises(NotBuiltError, match=r"job\.predict before the job is planned"):
            lazy.predict((batch[0],))
        job = plait.parallelize(
            TinyGPT(GPT), ParallelConfig(mode="data_parallel", mesh={"dp": 4}),
            optimizer=_sgd, loss_fn=gpt_loss,
        )  # fmt: skip
        with pytest.raises(ShardingError, match="holds no tensor"):
            job.predict({"flag": True})


class _RowParallel(torch.nn.Module):
    """Hybrid mode's own layout-aware code: a row-parallel matmul over tp."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 12, generator=torch.Generator().manual_seed(3)))

    def forward(self, x):
        return plait.ops.matmul(x, self.w, strategy=((2, 2), (2, 1)))


def test_hybrid_predicts_with_the_users_collectives_and_one_gather() -> None:
    """mode hybrid: the user's forward runs on its DTensor parameters (its tp all-reduce) and
    the rows, split over dp, are gathered once."""
    net = _RowParallel()
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(4))
    expected = x @ net.w.detach()
    with plait.testing.simulate(world_size=4):
        job = plait.parallelize(
            net,
            ParallelConfig(mode="hybrid", mesh=MEGATRON),
            optimizer=_sgd,
            loss_fn=lambda m, b: m(b[0]).square().mean(),
        )
        with CommDebugMode() as comm:
            out = job.predict((x,))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    assert _named(comm.get_comm_counts()) == {"all_reduce": 1, "all_gather_into_tensor": 1}
