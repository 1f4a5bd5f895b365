"""Pictures with matplotlib (plait.planning.plots): what each figure is handed, the files
written, and the refusal without matplotlib. Single process, no process group."""

from __future__ import annotations

import dataclasses
import struct
import subprocess
import sys

import pytest
import torch

from plait.cli import main
from plait.config import ParallelConfig
from plait.errors import MissingExtraError, PlanError
from plait.graph import capture
from plait.models import GPTConfig, TinyGPT, gpt_loss
from plait.planning import plan_graph, plots
from plait.planning.timeline import StageTimes, schedule_order, simulate, timeline_from_records
from plait.runtime.engine.report import RunReport, plot_memory

PNG = b"\x89PNG\r\n\x1a\n"
SMALL = ["plan", "--layers", "2", "--hidden", "32", "--heads", "4", "--seq", "16", "--vocab",
         "64", "--batch", "8", "--devices", "4"]  # fmt: skip


@pytest.fixture(scope="module")
def graph():
    with torch.device("meta"):
        model = TinyGPT(GPTConfig(vocab=64, seq=16, width=32, heads=4, layers=2))
        ids = torch.zeros(8, 16, dtype=torch.long)
    return capture(model, (ids, ids), gpt_loss)


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _bars(ax) -> dict[str, list]:
    """The bar containers of an axes by label: the patches handed to matplotlib."""
    return {c.get_label(): list(c.patches) for c in ax.containers}


def test_timeline_bars_are_the_schedules_passes(tmp_path) -> None:
    times = StageTimes(forward_s=1e-3, backward_s=2e-3, weight_s=1e-3, send_s=1e-4)
    timeline = simulate("zero_bubble", 2, 4, times, 2)
    figure = plots.timeline_figure(timeline)
    (ax,) = figure.axes
    bars = _bars(ax)
    assert set(bars) == {"forward", "backward (input gradient)", "weight gradient",
                         "communication", plots.IDLE_LABEL}  # fmt: skip
    orders = schedule_order("zero_bubble", 2, 4, 2)
    for rank, order in enumerate(orders):  # one bar per pass of the rank's order, in its row
        for label, kind in (("forward", "forward"), ("backward (input gradient)", "backward"),
                            ("weight gradient", "weight")):  # fmt: skip
            mine = [p for p in bars[label] if round(p.get_y() + p.get_height() / 2) == rank]
            assert len(mine) == sum(a.kind == kind for a in order), (rank, kind)
    idle = sum(len(timeline.idle(r)) for r in range(2))
    assert len(bars[plots.IDLE_LABEL]) == idle > 0
    assert ax.get_title(loc="left") == plots.timeline_title(timeline)
    assert plots.timeline_title(timeline).startswith("predicted pipeline step: bubble")
    # the old API writes through matplotlib: a PNG of the width asked for
    width, height = timeline.to_png(tmp_path / "step.png", width=900)
    assert _png_size(tmp_path / "step.png") == (width, height) and width == 900
    assert timeline.png(width=600)[:8] == PNG
    with pytest.raises(PlanError, match="width=100"):
        timeline.to_png(tmp_path / "small.png", width=100)


def test_predicted_and_measured_timelines_are_two_panels() -> None:
    predicted = simulate("1f1b", 2, 2, StageTimes(forward_s=1.0, backward_s=2.0))
    measured = timeline_from_records(
        [(0, "forward", 0, 0, 0.0, 1.0), (1, "forward", 1, 0, 1.0, 2.0),
         (1, "backward", 1, 0, 2.0, 4.0), (0, "backward", 0, 0, 4.0, 6.0)],
        title="measured 1f1b",
    )  # fmt: skip
    figure = plots.timeline_figure(predicted, measured)
    top, bottom = figure.axes[:2]
    assert bottom.get_title(loc="left").startswith("measured 1f1b: bubble")
    assert len(_bars(top)["forward"]) == 4 and len(_bars(bottom)["forward"]) == 2


def test_plan_plot_writes_memory_and_the_timeline(graph, tmp_path) -> None:
    plan = plan_graph(graph, ParallelConfig(mode="data_parallel", devices=4, pipeline_stages=2,
                                            micro_batches=4))  # fmt: skip
    written = plan.plot(tmp_path / "pictures")
    assert [p.name for p in written] == ["memory.png", "timeline.png"]  # no options: not auto
    assert all(_png_size(p)[0] >= 480 for p in written)
    columns = plots.plan_memory_columns(plan)
    figure = plots.memory_figure(columns)
    unit = figure.axes[0].get_ylabel().rsplit("(", 1)[1].rstrip(")")
    unit_per = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10, "bytes": 1}[unit]
    bars = _bars(figure.axes[0])
    assert list(bars) == list(plan.predicted.memory_by_kind)  # one stack segment per kind
    for kind, value in plan.predicted.memory_by_kind.items():
        assert bars[kind][0].get_height() == pytest.approx(value / unit_per)
    with pytest.raises(PlanError, match="weighed no options"):
        plots.options_figure(plan)


def test_options_mark_the_chosen_plan_and_draw_the_limit(graph) -> None:
    plan = plan_graph(graph, ParallelConfig(mode="auto", devices=4, memory_limit="1MiB"))
    assert len(plan.options) > 2
    figure = plots.options_figure(plan)
    ax = figure.axes[0]
    by_label = {c.get_label(): c.get_offsets() for c in ax.collections}
    chosen = next(v for k, v in by_label.items() if k.startswith(plots.CHOSEN_LABEL))
    # memory in MiB across, step time in ms up (the axes' labels say so)
    assert "(MiB)" in ax.get_xlabel() and "(ms)" in ax.get_ylabel()
    assert chosen.tolist() == [[pytest.approx(plan.predicted.memory_bytes / 2**20),
                                pytest.approx(plan.predicted.step_time_s * 1e3)]]  # fmt: skip
    others = sum(len(v) for k, v in by_label.items() if not k.startswith(plots.CHOSEN_LABEL))
    assert others == len(plan.options)  # every option the plan keeps is a point
    over = by_label.get("over the memory limit", [])
    assert len(over) == sum(not o.feasible for o in plan.options)
    (limit,) = [line for line in ax.get_lines() if line.get_label() == "memory limit"]
    assert limit.get_xdata()[0] == pytest.approx(1.0)  # 1 MiB


def test_cli_plot_writes_the_plans_pictures(tmp_path, capsys) -> None:
    out = tmp_path / "pics"
    assert main([*SMALL, "--memory-limit", "1MiB", "--plot", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"pictures written: {out / 'memory.png'}, {out / 'options.png'}" in printed
    assert _png_size(out / "options.png")[0] == 900


def test_run_report_plots_predicted_beside_measured(tmp_path) -> None:
    predicted = simulate("1f1b", 2, 2, StageTimes(forward_s=1.0, backward_s=2.0))
    measured = timeline_from_records(
        [(0, "forward", 0, 0, 0.0, 1.0), (1, "forward", 1, 0, 1.0, 2.0)]
    )
    report = RunReport(
        predicted_step_s=1.0, measured_step_s=1.2, steps_measured=2,
        predicted_memory_bytes=3000, measured_peak_bytes=3500,
        memory_source="measure_step_memory",
        predicted_by_kind=(("parameters", 1000), ("activations", 2000)),
        measured_by_kind=(("parameters", 1000), ("activations", 2400)),
        measured_timeline=measured, predicted_timeline=predicted,
    )  # fmt: skip
    columns = report.memory_columns()
    assert [(c.rank, c.source, c.peak) for c in columns] == [
        ("rank 0", "predicted", 3000), ("rank 0", "measured", 3500)
    ]  # fmt: skip
    bars = _bars(plots.memory_figure(columns).axes[0])
    assert [p.get_height() for p in bars["activations"]] == pytest.approx(
        [2000 / 1024, 2400 / 1024]
    )
    written = report.plot(tmp_path)
    assert [p.name for p in written] == ["memory_rank0.png", "timeline.png"]
    assert all(p.read_bytes()[:8] == PNG for p in written)
    empty = RunReport(None, None, 0, None, None, "not measured")
    with pytest.raises(PlanError, match="nothing to draw"):
        empty.plot(tmp_path)
    # every rank's report in one picture: each rank's prediction beside its measurement
    other = dataclasses.replace(report, rank=1, measured_by_kind=(("activations", 5000),))
    path = plot_memory([other, report], tmp_path / "memory.png")
    assert path.read_bytes()[:8] == PNG
    columns = [c for r in (report, other) for c in r.memory_columns()]
    assert [(c.rank, c.source) for c in columns][2:] == [
        ("rank 1", "predicted"),
        ("rank 1", "measured"),
    ]
    assert len(_bars(plots.memory_figure(columns).axes[0])["activations"]) == 4
    with pytest.raises(PlanError, match="hold no memory by kind"):
        plot_memory([empty], tmp_path / "none.png")


def test_loss_figure_draws_every_step() -> None:
    losses = [3.0, 2.5, 2.0, 1.8]
    figure = plots.loss_figure(losses, first_step=5, eval_losses=[(4, 3.1), (8, 1.9)])
    train, evals = figure.axes[0].get_lines()
    assert list(train.get_xdata()) == [5, 6, 7, 8] and list(train.get_ydata()) == losses
    assert list(evals.get_ydata()) == [3.1, 1.9]
    with pytest.raises(PlanError, match="not finite"):
        plots.loss_figure([1.0, float("nan")])


def test_without_matplotlib_pictures_are_refused_by_name(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    timeline = simulate("1f1b", 2, 2, StageTimes(forward_s=1.0, backward_s=2.0))
    with pytest.raises(MissingExtraError, match=r"pip install 'plait\[plot\]'") as e:
        timeline.to_png(tmp_path / "t.png")
    assert isinstance(e.value, ImportError) and "the pipeline timeline" in str(e.value)
    assert main([*SMALL, "--plot", str(tmp_path / "p")]) == 2
    assert "plait plan: error: plan.plot draws with matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "t.png").exists() and not (tmp_path / "p").exists()


def test_import_plait_does_not_import_matplotlib() -> None:
    code = "import sys, plait, plait.planning.plots; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_demos_plot_flag_is_refused_before_training_without_matplotlib(
    monkeypatch, tmp_path, capsys
) -> None:
    from plait.demo.train import parse_args

    assert parse_args(["--plot", str(tmp_path)]).plot == tmp_path
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit):
        parse_args(["--plot", str(tmp_path)])
    assert "--plot draws with matplotlib" in capsys.readouterr().err
