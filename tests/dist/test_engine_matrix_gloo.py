"""Issue 30's engine-parity matrix on real gloo processes: every layout x every option, for a
model with ``F.scaled_dot_product_attention`` and for a Hugging Face Llama called as its docs
show, each case trained equal to one device or refused by name before any collective.

Layouts (4 processes): ``dp4``, ``dp2_tp2``, ``pp2_dp2``, ``pp2_tp2``; and ``pp2_dp2_tp2`` on
8 processes. Options: none, ZeRO-1, ZeRO-3, selective recompute, bf16 and ``full_batch``
(every rank passes the global batch; otherwise each passes its data-parallel replica's rows).
Every case plans in mode auto on its fixed mesh (a pure data-parallel plan run as the
per-rank program on ``dp4``; the pipeline layouts' stages are the plan's), 2 SGD steps from
the same weights on the same global batches; fp32 cases equal one device to
``assert_same_run``'s 1e-5, bf16 ones one device under the same autocast to bf16's tolerance
(two roundings apart, see ``BF16_TOLERANCE``). SGD: no Adam step turns rounding noise into
lr-sized moves. On the pipeline layouts every stage runs as its compiled program (eager only
where the job runs optimizer parallel beside bf16, which mode auto may choose itself: the
documented exception) and none falls back to eager (``program.refused``); where a plan holds
the stages, each compiled stage runs the collectives the plan lists
(``job.plan_mismatches`` empty).

Cases a version of plait does not run are listed in ``REFUSED`` with the words their error
must say: such a case must raise a :class:`plait.PlaitError` at ``parallelize``, before any
collective (every rank raises it, nobody waits). A case refused that is not listed, or listed
and not refused, fails.

The Hugging Face Llama's batches are dicts (``input_ids``, ``labels``) and its loss is the
model's own, ``model(**batch).loss``; on pipelines ``labels`` is carried to the last stage.

Nightly: 48 cases on 4 processes and 12 on 8 (``pp2_dp2_tp2``), every one trains equal to
one device: about 4 and 3 minutes on 2 cores. (The 8-process layout's stages once followed
DTensor's propagation instead of the plan and died in ``rms_norm`` on a pending mean; the
stages now lay their ops' inputs out as the plan says,
:mod:`plait.runtime.pipeline.planned_stage`.) The default
suite's share of the matrix is ``tests/dist/test_engine_parity_gloo.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

import plait
from plait import ParallelConfig, PlaitError
from plait.models import lm_loss
from plait.testing import run_workers
from plait.testing.equivalence import Run, assert_same_run, reference_run
from tests.dist.test_engine_parity_gloo import (  # the same models, batches and optimizer
    _batches,
    _hf_batches,
    _hf_llama,
    _model,
    _sgd,
    own_loss,
)

pytestmark = pytest.mark.dist


LAYOUTS: dict[str, dict[str, int]] = {
    "dp4": {"dp": 4},
    "dp2_tp2": {"dp": 2, "tp": 2},
    "pp2_dp2": {"pp": 2, "dp": 2},
    "pp2_tp2": {"pp": 2, "tp": 2},
}
LAYOUTS_8 = {"pp2_dp2_tp2": {"pp": 2, "dp": 2, "tp": 2}}
OPTIONS: dict[str, dict[str, Any]] = {
    "plain": {},
    "zero1": {"optimizer_shard": 1},
    "zero3": {"optimizer_shard": 3},
    "selective": {"recompute": "selective"},
    "bf16": {"precision": "bf16"},
    "full_batch": {"dataset_strategy": "full_batch"},
}
REFUSED: dict[str, str] = {}
"""Case name -> words its refusal must contain (none today: every case trains)."""

BF16_TOLERANCE = {"rtol": 2e-2, "atol": 2e-3}
"""bf16 against one device under the same autocast: bf16 keeps 8 bits of mantissa (2**-8 ~
4e-3 relative per rounding), and a product split over tp sums its pieces in another order,
so two roundings apart is what equal training means there (fp32 cases: 1e-5)."""


def config_of(layout: dict[str, int], option: dict[str, Any]) -> ParallelConfig:
    """A case's configuration: mode auto on the layout's mesh, with the option."""
    pipeline = {"micro_batches": 4} if "pp" in layout else {}
    return ParallelConfig(mode="auto", mesh=layout, **pipeline, **option)


def cases(layouts: dict[str, dict[str, int]], hf: bool) -> dict[str, ParallelConfig]:
    prefix = "hf_" if hf else ""
    return {
        f"{prefix}{name}_{opt}": config_of(layout, option)
        for name, layout in layouts.items()
        for opt, option in OPTIONS.items()
    }


def _rows_for(job: plait.Job, batch: Any) -> Any:
    """What this rank passes to ``step``: the global batch under ``full_batch`` (or without a
    dp axis), else its data-parallel replica's rows."""
    if job.config.dataset_strategy == "full_batch" or "dp" not in job.mesh.axis_names:
        return batch
    dp = job.device_mesh.get_coordinate()[job.mesh.axis_index("dp")]
    size = job.mesh.axis_size("dp")
    if isinstance(batch, dict):
        return {k: v.chunk(size)[dp] for k, v in batch.items()}
    return tuple(x.chunk(size)[dp] for x in batch)


def _run_cases(eight: bool, hf: bool, only: tuple[str, ...] = ()) -> dict[str, Any]:
    """Every case on this rank (the 8-process layouts' or the 4-process ones'; configurations
    do not pickle, so each rank builds them): its run and how its stages ran, or its
    refusal."""
    plait.init()
    configs = cases(LAYOUTS_8 if eight else LAYOUTS, hf)
    out: dict[str, Any] = {}
    for name, config in configs.items():
        if only and name not in only:
            continue
        batches = _hf_batches() if hf else _batches()
        model = _hf_llama() if hf else _model()
        try:
            job = plait.parallelize(
                model,
                config,
                optimizer=_sgd,
                loss_fn=own_loss if hf else lm_loss,
                example_batch=batches[0],
            )
        except PlaitError as e:
            out[name] = {"refused": f"{type(e).__name__}: {e}"}
            continue
        losses = [job.step(_rows_for(job, b)) for b in batches]
        programs = getattr(job, "stage_programs", [])
        out[name] = {
            "run": Run(losses, job.full_state_dict()),
            "mismatches": getattr(job, "plan_mismatches", None),
            "held": getattr(job, "plan", None) is not None,
            "eager_stages": [p.refused for p in programs if p.refused is not None],
            "stages": len(getattr(job, "stage_modules", [])),
            "compiled": sum(p.calls > 0 for p in programs),
            # the settings the job runs (mode auto may choose ZeRO itself): optimizer
            # parallel beside bf16 keeps the stages eager, documented
            "compiles": job.config.compiled_stages,
            "ran": (job.config.optimizer_shard, job.config.precision),
        }
    return out


def _check(results: list[dict[str, Any]], configs: dict[str, ParallelConfig], hf: bool) -> None:
    model, loss_fn, batches = (
        (_hf_llama(), own_loss, _hf_batches()) if hf else (_model(), lm_loss, _batches())
    )
    fp32 = reference_run(model, loss_fn, _sgd, batches)
    bf16 = reference_run(model, loss_fn, _sgd, batches, autocast=torch.bfloat16)
    failures = []
    for name, config in configs.items():
        for rank, result in enumerate(results):
            got = result[name]
            if "refused" in got:
                words = REFUSED.get(name)
                if words is None or words not in got["refused"]:
                    failures.append(f"{name} rank {rank}: refused: {got['refused']}")
                continue
            if name in REFUSED:
                failures.append(f"{name} rank {rank}: trained, but REFUSED lists it")
                continue
            try:
                if config.precision == "bf16":
                    assert_same_run(bf16, got["run"], **BF16_TOLERANCE)
                else:
                    assert_same_run(fp32, got["run"])
            except AssertionError as e:
                failures.append(f"{name} rank {rank}: {str(e)[:400]}")
            if got["eager_stages"]:
                failures.append(f"{name} rank {rank}: eager stages {got['eager_stages']}")
            if got["compiled"] != (got["stages"] if got["compiles"] else 0):
                failures.append(
                    f"{name} rank {rank}: {got['compiled']} of {got['stages']} stages compiled "
                    f"(ran optimizer_shard, precision {got['ran']})"
                )
            if got["held"] and got["mismatches"]:
                failures.append(f"{name} rank {rank}: plan mismatches {got['mismatches']}")
    assert not failures, "\n".join(failures)


@pytest.mark.nightly
@pytest.mark.timeout(1500)  # the workers' own bound: 24 cases in one run, past pytest's 300 s
@pytest.mark.parametrize("hf", [False, True], ids=["sdpa_llama", "hf_llama"])
def test_every_4_process_layout_and_option_trains_like_one_device_nightly(hf: bool) -> None:
    if hf:
        pytest.importorskip("transformers")
    configs = cases(LAYOUTS, hf)
    _check(run_workers(_run_cases, 4, False, hf, timeout_s=1500), configs, hf)


@pytest.mark.nightly
@pytest.mark.timeout(1500)  # the workers' own bound, as above
@pytest.mark.parametrize("hf", [False, True], ids=["sdpa_llama", "hf_llama"])
def test_pp2_dp2_tp2_on_8_processes_trains_like_one_device_nightly(hf: bool) -> None:
    if hf:
        pytest.importorskip("transformers")
    configs = cases(LAYOUTS_8, hf)
    _check(run_workers(_run_cases, 8, True, hf, timeout_s=1500), configs, hf)


def test_the_matrix_is_every_layout_by_every_option() -> None:
    """The cases are the cross product (no case silently dropped), and each configuration is
    what its name says."""
    configs = cases(LAYOUTS, hf=False)
    assert len(configs) == len(LAYOUTS) * len(OPTIONS) == 24
    zero3 = configs["pp2_tp2_zero3"]
    assert zero3.mesh_dict == {"pp": 2, "tp": 2} and zero3.optimizer_shard == 3
    assert dataclasses.replace(zero3, optimizer_shard=None) == configs["pp2_tp2_plain"]
    assert set(cases(LAYOUTS_8, hf=True)) == {f"hf_pp2_dp2_tp2_{o}" for o in OPTIONS}
