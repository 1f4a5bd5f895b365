"""The GPT example: a character-level GPT trained on the bundled corpus, in any built mode.

Run it under ``plait run`` (``make demo`` does ``plait run --worker-num 4 -m plait.demo.train``;
``examples/gpt/train.py`` is the same program as a script). Every rank builds the same model
(seeded), draws the same global batches from a seeded generator, and passes its own slice of
each batch to ``job.step``: ranks with the same ``dp`` coordinate get the same slice.

Rank 0 draws the progress bar and prints evaluation losses and the final summary; the other
ranks log the same events with ``logging`` into their own files (``worker_<rank>.log`` under
``plait run --log-dir``). The program exits with status 1 if the training loss did not fall.

The model is :class:`plait.models.gpt.TinyGPT`: token and position embeddings, pre-norm
blocks with causal multi-head attention (explicit matmuls and softmax), a GELU MLP, a final
LayerNorm and an LM head.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch
from tqdm import tqdm

import plait
from plait.checkpoint import Checkpoints
from plait.config import LogFormat
from plait.cost import UNCALIBRATED
from plait.launch import detect_environment
from plait.models import GPTConfig, TinyGPT, annotate_megatron, gpt_loss

logger = logging.getLogger("plait.demo.gpt")

CORPUS = Path(__file__).with_name("corpus.txt")
MODES = ("stand_alone", "data_parallel", "semi_auto", "auto")
SEARCHERS = ("sharding_propagation", "recursive_programming", "dynamic_programming", "ilp")
Batch = tuple[torch.Tensor, torch.Tensor]


# -- arguments ----------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line; defaults are the ``make demo`` run (about a minute on 4 CPU workers)."""
    p = argparse.ArgumentParser(prog="plait GPT example", description=__doc__.split("\n", 1)[0])
    p.add_argument("--mode", choices=MODES, default=None,
                   help="parallel mode (default semi_auto; auto with --plan)")  # fmt: skip
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size (semi_auto)")
    p.add_argument("--search", choices=SEARCHERS, default="dynamic_programming",
                   help="strategy searcher (auto: plait plans the mesh and every op)")  # fmt: skip
    p.add_argument("--plan", type=Path, metavar="PATH",
                   help="run a saved plan file (from --save-plan or `plait plan`) as it is; "
                        "its mesh, precision and gradient accumulation are the run's")  # fmt: skip
    p.add_argument("--save-plan", type=Path, metavar="PATH",
                   help="mode auto: write the plan the run uses to PATH (rank 0)")  # fmt: skip
    p.add_argument("--grad-accumulation", type=int, default=1, metavar="K",
                   help="micro-batches per step, one gradient reduction")  # fmt: skip
    p.add_argument("--optimizer-shard", type=int, choices=(1, 2, 3), default=None,
                   help="optimizer parallel level (ZeRO-1/2/3) over dp")  # fmt: skip
    p.add_argument("--recompute", choices=("none", "selective", "full", "auto"), default="none",
                   help="activation recompute of every block")  # fmt: skip
    p.add_argument("--offload", choices=("optimizer", "activations"), default=None,
                   help="keep the optimizer or saved activations in host memory")  # fmt: skip
    p.add_argument("--checkpoint-dir", type=Path, metavar="DIR", default=None,
                   help="where checkpoints go (default $PLAIT_CHECKPOINT_DIR, which plait run "
                        "--checkpoint-dir sets)")  # fmt: skip
    p.add_argument("--save-every", type=int, default=0, metavar="N",
                   help="save a checkpoint every N steps (0: never)")  # fmt: skip
    p.add_argument("--keep", type=int, default=2, metavar="K",
                   help="checkpoints kept (the newest K)")  # fmt: skip
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest complete checkpoint in the checkpoint dir",
    )
    p.add_argument(
        "--pp",
        type=int,
        default=1,
        metavar="P",
        help="pipeline stages (mode data_parallel: a mesh of pp=P x dp=world/P; with --mode "
        "semi_auto: pp=P x dp x tp=--tp, tensor parallel inside the stages)",
    )
    p.add_argument("--micro-batches", type=int, default=None, metavar="M",
                   help="pipeline micro-batches a step (default 2 x --pp)")  # fmt: skip
    p.add_argument("--schedule", default="1f1b",
                   choices=("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zero_bubble_v"),
                   help="pipeline schedule")  # fmt: skip
    p.add_argument("--steps", type=int, default=250, help="optimizer steps")
    p.add_argument("--batch", type=int, default=16, help="global batch size (sequences)")
    p.add_argument("--seq", type=int, default=32, help="sequence length (characters)")
    p.add_argument("--width", type=int, default=64, help="model width")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--eval-every", type=int, default=50, help="steps between evaluations")
    p.add_argument("--eval-batches", type=int, default=2, help="batches per evaluation")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and the batches")
    p.add_argument("--corpus", type=Path, default=CORPUS, help="a text file to train on")
    p.add_argument("--sample", type=int, default=120, metavar="N",
                   help="characters to generate with job.predict after training (0: none)")  # fmt: skip
    p.add_argument("--calibrate", action="store_true",
                   help="plan on this machine's numbers, measured first for a few seconds on "
                        "the workers (make demo does)")  # fmt: skip
    p.add_argument("--reuse-calibration", action="store_true",
                   help="plan on a saved calibration of this machine for this many workers "
                        "(plait calibrate's, or an earlier --calibrate's); measure when none "
                        "fits")  # fmt: skip
    p.add_argument("--plot", type=Path, metavar="DIR", default=None,
                   help="write pictures into DIR after training (needs matplotlib: pip install "
                        "'plait[plot]'): training.png (loss per step), memory.png (every "
                        "rank's memory by kind, predicted beside measured), timeline.png "
                        "(pipelines: the last step measured)")  # fmt: skip
    p.add_argument("--log-dir", type=Path, metavar="DIR", default=None,
                   help="rank 0 writes each step's loss, step time (and the plan's predicted "
                        "one), tokens/s and peak memory to DIR: TensorBoard event files "
                        "(tensorboard --logdir DIR) and DIR/metrics.jsonl")  # fmt: skip
    p.add_argument("--log-level", default="INFO", type=str.upper,
                   choices=("DEBUG", "INFO", "WARNING", "ERROR"), help="logging level")  # fmt: skip
    args = p.parse_args(argv)
    if args.pp > 1 and args.mode not in ("data_parallel", "semi_auto", None):
        p.error(f"--pp runs pipeline stages in mode data_parallel, or semi_auto with --tp; "
                f"drop --mode {args.mode}")  # fmt: skip
    if args.pp > 1:
        args.mode = args.mode or "data_parallel"
    args.mode = args.mode or ("auto" if args.plan is not None else "semi_auto")
    args.micro_batches = args.micro_batches or (2 * args.pp if args.pp > 1 else 1)
    for name in ("tp", "pp", "micro_batches", "grad_accumulation", "steps", "batch", "seq",
                 "width", "layers", "heads", "eval_every", "eval_batches"):  # fmt: skip
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.save_every < 0 or args.keep < 1:
        p.error("--save-every must be >= 0 and --keep >= 1")
    if args.checkpoint_dir is None and os.environ.get("PLAIT_CHECKPOINT_DIR"):
        args.checkpoint_dir = Path(os.environ["PLAIT_CHECKPOINT_DIR"])
    if (args.save_every or args.resume) and args.checkpoint_dir is None:
        p.error("--save-every and --resume need --checkpoint-dir DIR (or plait run "
                "--checkpoint-dir)")  # fmt: skip
    if args.width % args.heads:
        p.error(f"--width {args.width} is not divisible by --heads {args.heads}")
    _check_plot(p, args)
    if args.plan is not None and args.mode != "auto":
        p.error(f"--plan runs a saved plan, which is mode auto; drop --mode {args.mode}")
    if args.save_plan is not None and (args.mode != "auto" or args.plan is not None):
        p.error("--save-plan saves the plan mode auto makes: use it with --mode auto, no --plan")
    return args


def _check_plot(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--plot`` without matplotlib is refused before training, not after it."""
    if args.plot is None:
        return
    from plait.planning.plots import require_matplotlib

    try:
        require_matplotlib("--plot")
    except plait.MissingExtraError as e:
        p.error(str(e))


def mesh_for(args: argparse.Namespace, world_size: int) -> dict[str, int] | None:
    """The mesh of ``--mode`` on ``world_size`` ranks (None for stand_alone)."""
    if args.mode in ("stand_alone", "auto"):  # auto: the planner chooses the mesh
        return None
    if args.mode == "data_parallel" and args.pp > 1:
        if world_size % args.pp:
            raise SystemExit(
                f"--pp {args.pp} needs a world size divisible by {args.pp} (world size "
                f"{world_size}); run under `plait run --worker-num {2 * args.pp}`"
            )
        return {"pp": args.pp, "dp": world_size // args.pp}
    if args.mode == "data_parallel":
        return {"dp": world_size}
    tp, pp = args.tp, args.pp
    if world_size % (tp * pp) or args.heads % tp:
        raise SystemExit(
            f"semi_auto with --tp {tp} --pp {pp} needs a world size divisible by {tp * pp} and "
            f"--heads divisible by {tp} (world size {world_size}, heads {args.heads}); run "
            f"under `plait run --worker-num {2 * tp * pp}` or pick another --tp"
        )
    if pp > 1:  # tensor parallel inside the pipeline's stages
        return {"pp": pp, "dp": world_size // (tp * pp), "tp": tp}
    return {"dp": world_size // tp, "tp": tp}


def check_batch(args: argparse.Namespace, dp: int) -> None:
    """The global batch must split into ``dp`` slices of ``grad_accumulation`` (or pipeline)
    micro-batches."""
    micro = args.grad_accumulation * args.micro_batches
    if args.batch % (dp * micro):
        raise SystemExit(
            f"--batch {args.batch} does not split into {dp} data-parallel slices of {micro} "
            f"micro-batches; use a multiple of {dp * micro}"
        )


# -- data ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Corpus:
    """A character-level corpus: ids of the training and evaluation parts, and the alphabet."""

    train: torch.Tensor
    eval: torch.Tensor
    chars: str


def load_corpus(path: Path, eval_fraction: float = 0.1) -> Corpus:
    """Read ``path`` and split it: the last ``eval_fraction`` of the text is for evaluation."""
    text = path.read_text(encoding="utf-8")
    chars = "".join(sorted(set(text)))
    index = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([index[c] for c in text], dtype=torch.long)
    cut = int(len(ids) * (1 - eval_fraction))
    return Corpus(train=ids[:cut], eval=ids[cut:], chars=chars)


def sample_batch(data: torch.Tensor, seq: int, batch: int, gen: torch.Generator) -> Batch:
    """``batch`` random windows of ``seq`` characters and the same windows shifted by one."""
    if len(data) <= seq + 1:
        raise SystemExit(f"a corpus part of {len(data)} characters is too short for --seq {seq}")
    starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen).tolist()
    ids = torch.stack([data[s : s + seq] for s in starts])
    targets = torch.stack([data[s + 1 : s + seq + 1] for s in starts])
    return ids, targets


def dp_place(job: plait.Job) -> tuple[int, int]:
    """This rank's data-parallel (index, size); (0, 1) without a mesh."""
    if job.device_mesh is None or job.mesh is None or "dp" not in job.mesh.axis_names:
        return 0, 1  # no data-parallel axis: every rank reads the whole batch
    coordinate = job.device_mesh.get_coordinate()
    assert coordinate is not None  # every rank is on the job's mesh
    return int(coordinate[job.mesh.axis_index("dp")]), job.mesh.axis_size("dp")


def local_slice(batch: Batch, index: int, size: int) -> Batch:
    """This rank's slice of a global batch: piece ``index`` of ``size`` along dim 0."""
    ids, targets = batch
    return ids.chunk(size)[index], targets.chunk(size)[index]


# -- output -------------------------------------------------------------------------------------


class LineStream:
    """A file for tqdm that turns each redraw into a whole line.

    Under ``plait run`` stdout is a log file that the launcher echoes line by line; carriage
    returns would come out as fragments. Here every non-blank redraw becomes one line, and a
    redraw of the same step as the line before it (the same text up to the bar's ``[``) is
    dropped.
    """

    def __init__(self, target: TextIO) -> None:
        self.target = target
        self.last = ""

    def write(self, text: str) -> int:
        for piece in text.replace("\r", "\n").split("\n"):
            line = piece.rstrip()
            key = line.split("[", 1)[0]
            if line.strip() and key != self.last:
                self.target.write(line + "\n")
                self.last = key
        return len(text)

    def message(self, text: str) -> None:
        """Write ``text`` as it is (not a redraw: never dropped)."""
        self.target.write(text + "\n")
        self.target.flush()
        self.last = ""

    def flush(self) -> None:
        self.target.flush()


def progress_bar(steps: int, stream: TextIO | LineStream, *, enabled: bool) -> tqdm:
    """Rank 0's bar; on a log file (``LineStream``) one line every 5 s at most, none before 5 s."""
    pace = {"mininterval": 5.0, "delay": 5.0} if isinstance(stream, LineStream) else {}
    return tqdm(total=steps, desc="train", unit="step", file=stream, disable=not enabled,
                ncols=100, **pace)  # fmt: skip


def configure_logging(level: str, rank: int) -> None:
    """Log records of every rank go to stderr (``plait run`` merges it into the rank's log)."""
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
        force=True,
    )


def reporter(rank: int, stream: TextIO | LineStream) -> Callable[[str], None]:
    """Rank 0 writes events to the console (above a live bar on a terminal); others log them."""
    if rank != 0:
        return logger.info
    if isinstance(stream, LineStream):
        return stream.message
    return lambda msg: tqdm.write(msg, file=stream)


# -- training -----------------------------------------------------------------------------------


@dataclass
class Summary:
    """What a run did; ``text()`` is the block rank 0 prints at the end."""

    mode: str
    mesh: dict[str, int] | None
    parameters: int
    steps: int
    tokens_per_step: int
    first_loss: float
    last_loss: float
    eval_losses: list[tuple[int, float]]
    train_seconds: float
    wall_seconds: float
    plan: str = ""
    """Mode auto: the searcher and the plan's predicted step time."""
    hardware: str = ""
    """With --calibrate: the hardware profile the plan was made on, and where it came from."""
    sample: str = ""
    """Text the trained model generated (``job.predict``), after an evaluation prompt."""
    losses: list[float] = field(default_factory=list)
    """The training loss of every step run, in order (from step ``steps_from``)."""
    steps_from: int = 1
    pictures: list[Path] = field(default_factory=list)
    """With --plot: the pictures this rank wrote."""

    @property
    def tokens_per_second(self) -> float:
        return self.steps * self.tokens_per_step / self.train_seconds

    @property
    def loss_fell(self) -> bool:
        return self.last_loss < self.first_loss

    def text(self) -> str:
        first_eval, last_eval = self.eval_losses[0][1], self.eval_losses[-1][1]
        return "\n".join([
            "summary",
            f"  mode        {self.mode}, mesh {self.mesh or 'none (one device per rank)'}",
            f"  model       TinyGPT, {self.parameters:,} parameters",
            f"  steps       {self.steps} x {self.tokens_per_step:,} tokens",
            f"  train loss  {self.first_loss:.4f} -> {self.last_loss:.4f} (first step -> mean of the last 10%)",
            f"  eval loss   {first_eval:.4f} -> {last_eval:.4f}",
            f"  throughput  {self.tokens_per_second:,.0f} tokens/s",
            f"  wall time   {self.wall_seconds:.1f} s ({self.train_seconds:.1f} s training)",
            *([f"  hardware    {self.hardware}"] if self.hardware else []),
            *([f"  plan        {self.plan}"] if self.plan else []),
            *([f"  sample      {self.sample!r}"] if self.sample else []),
            *([f"  pictures    {', '.join(map(str, self.pictures))}"] if self.pictures else []),
        ])  # fmt: skip


def makes_plan(args: argparse.Namespace) -> bool:
    """Whether the run plans (and so predicts its step time): modes auto and semi_auto, a plan
    file, a memory pass (ZeRO, recompute, offload) or pipeline stages."""
    memory = args.optimizer_shard is not None or args.recompute != "none" or args.offload
    return (
        args.mode in ("auto", "semi_auto") or args.plan is not None or bool(memory) or args.pp > 1
    )


def build_job(args: argparse.Namespace, vocab: int, world_size: int, rank: int = 0) -> plait.Job:
    """Build the model (seeded: the same on every rank), annotate it and parallelize it."""
    mesh = mesh_for(args, world_size)
    torch.manual_seed(args.seed)
    cfg = GPTConfig(vocab=vocab, seq=args.seq, width=args.width, heads=args.heads,
                    layers=args.layers)  # fmt: skip
    model = TinyGPT(cfg)
    if args.mode == "semi_auto":
        annotate_megatron(model, args.tp)
    auto = args.mode == "auto"
    config: plait.ParallelConfig | plait.Plan = plait.ParallelConfig(
        mode=args.mode,
        mesh=mesh,
        grad_accumulation=args.grad_accumulation,
        search=args.search if auto else None,
        optimizer_shard=args.optimizer_shard,
        optimizer_shard_threshold=0 if args.optimizer_shard else 64 * 1024,  # a small model
        recompute=args.recompute,
        offload=args.offload,
        micro_batches=args.micro_batches,
        schedule=args.schedule,
        log_dir=args.log_dir,
        log_formats=metrics_formats(args.log_dir),
    )
    if args.plan is not None:
        config = plait.Plan.load(args.plan)
        args.grad_accumulation = config.grad_accumulation  # the plan's, for check_batch
        if args.log_dir is not None:  # a Plan object runs as it is: the file, with metrics
            config = plan_file_config(args.plan, config, args.log_dir)
    # auto and semi_auto plan on the shapes of one global batch (meta tensors: no memory);
    # given now, the plan (and its errors) come before training starts
    planned = makes_plan(args)
    example = torch.zeros(args.batch, args.seq, dtype=torch.long, device="meta")
    job = plait.parallelize(
        model,
        config,
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=args.lr),
        loss_fn=gpt_loss,
        example_batch=(example, example) if planned else None,
    )
    plan = getattr(job.loss_fn, "plan", None)
    if args.save_plan is not None and plan is not None and rank == 0:
        plan.save(args.save_plan)
        logger.info("plan saved to %s", args.save_plan)
    return job


def metrics_formats(log_dir: Path | None) -> tuple[LogFormat, ...]:
    """--log-dir writes TensorBoard event files where tensorboard is installed (``pip install
    'plait[metrics]'``), and the JSON-lines log always."""
    if log_dir is None or importlib.util.find_spec("tensorboard") is not None:
        return ("tensorboard", "jsonl")
    logger.warning("--log-dir: tensorboard is not installed (pip install 'plait[metrics]'): "
                   "writing %s/metrics.jsonl alone", log_dir)  # fmt: skip
    return ("jsonl",)


def plan_file_config(path: Path, plan: plait.Plan, log_dir: Path) -> plait.ParallelConfig:
    """``--plan PATH --log-dir DIR``: the saved plan as a config naming its file, with the
    job settings it was made with (a plan runs with those) and the metrics directory."""
    return plait.ParallelConfig(
        plan=path,
        precision=plan.precision,  # type: ignore[arg-type]
        grad_accumulation=plan.grad_accumulation,
        dp_axis=plan.dp_axis,
        dataset_strategy=plan.dataset_strategy,  # type: ignore[arg-type]
        comm_fusion=plan.comm_fusion,
        optimizer_shard=plan.optimizer_shard,  # type: ignore[arg-type]
        offload=plan.offload,  # type: ignore[arg-type]
        log_dir=log_dir,
        log_formats=metrics_formats(log_dir),
    )


def evaluate(job: plait.Job, batches: list[Batch], index: int, size: int) -> float:
    """Mean global loss over the fixed evaluation batches."""
    losses = [job.evaluate(local_slice(b, index, size)) for b in batches]
    return sum(losses) / len(losses)


def train(args: argparse.Namespace) -> Summary:
    """Train as ``args`` say and return the summary (on every rank)."""
    wall_start = time.perf_counter()
    world_size = 1
    if args.mode == "stand_alone":
        rank = detect_environment().rank  # no process group: every rank trains alone
    else:
        world = plait.init()
        rank, world_size = world.rank, world.world_size
    stream: TextIO | LineStream = sys.stdout if sys.stdout.isatty() else LineStream(sys.stdout)
    report = reporter(rank, stream)
    hardware = calibrate(args, world_size, report)
    corpus = load_corpus(args.corpus)
    job = build_job(args, len(corpus.chars), world_size, rank)
    index, size = dp_place(job)
    check_batch(args, size)
    logger.info("mesh %s, dp slice %d of %d, %d local sequences a step",
                job.mesh.as_dict() if job.mesh else None, index, size, args.batch // size)  # fmt: skip

    gen = torch.Generator().manual_seed(args.seed + 1)  # the same batches on every rank
    eval_batches = [
        sample_batch(corpus.eval, args.seq, args.batch, gen) for _ in range(args.eval_batches)
    ]
    params = sum(p.numel() for p in job.model.parameters())
    tokens = args.batch * args.seq
    report(
        f"plait GPT example: mode {args.mode}, mesh {job.mesh.as_dict() if job.mesh else None}, "
        f"{params:,} parameters; corpus {len(corpus.train):,} train + {len(corpus.eval):,} eval "
        f"characters ({len(corpus.chars)} distinct); {args.steps} steps of {args.batch} x "
        f"{args.seq} characters"
    )

    def run_eval() -> float:
        return evaluate(job, eval_batches, index, size)

    ckpt, saved = checkpoints(args, world_size), {"batches": GeneratorState(gen)}
    resumed = 0
    if ckpt is not None and args.resume:
        resumed = ckpt.resume(job, stateful=saved)
        report(f"resumed from step {resumed} ({ckpt.path})")
    eval_losses = [(resumed, run_eval())]
    report(f"step {resumed:5d}  eval loss {eval_losses[-1][1]:.4f}")
    bar = progress_bar(args.steps, stream, enabled=rank == 0)
    bar.update(resumed)
    losses: list[float] = []
    train_seconds = 0.0
    step_seconds: list[float] = []
    with bar:
        for step in range(resumed + 1, args.steps + 1):
            batch = local_slice(sample_batch(corpus.train, args.seq, args.batch, gen), index, size)
            start = time.perf_counter()
            losses.append(job.step(batch))
            step_seconds.append(time.perf_counter() - start)
            train_seconds += step_seconds[-1]
            rate = step * tokens / train_seconds
            logger.debug("step %d loss %.4f %.0f tokens/s", step, losses[-1], rate)
            bar.set_postfix_str(f"loss {losses[-1]:.4f}, {rate:,.0f} tok/s", refresh=False)
            bar.update(1)
            if ckpt is not None:
                ckpt.maybe_save(job, stateful=saved)
            if step % args.eval_every == 0 or step == args.steps:
                if step == args.steps:
                    bar.close()  # the bar's last line comes before the final evaluation
                eval_losses.append((step, run_eval()))
                report(f"step {step:5d}  eval loss {eval_losses[-1][1]:.4f}  "
                       f"train loss {losses[-1]:.4f}")  # fmt: skip

    if ckpt is not None:
        job.wait_for_save()
    job.close()  # the --log-dir files: complete now
    if not losses:
        raise SystemExit(f"nothing to train: the checkpoint is at step {resumed} of {args.steps}")
    tail = losses[-max(1, len(losses) // 10) :]
    sample = generate(job, corpus, args) if args.sample else ""
    summary = Summary(
        mode=args.mode,
        mesh=job.mesh.as_dict() if job.mesh else None,
        parameters=params,
        steps=args.steps - resumed,
        tokens_per_step=tokens,
        first_loss=losses[0],
        last_loss=sum(tail) / len(tail),
        eval_losses=eval_losses,
        train_seconds=train_seconds,
        wall_seconds=time.perf_counter() - wall_start,
        plan=_plan_line(job, step_seconds),
        hardware=hardware,
        sample=sample,
        losses=losses,
        steps_from=resumed + 1,
    )
    if args.plot is not None:
        batch = local_slice(sample_batch(corpus.train, args.seq, args.batch, gen), index, size)
        summary.pictures = plot_run(job, summary, args, batch, rank)
    return summary


def plot_run(
    job: plait.Job, summary: Summary, args: argparse.Namespace, batch: Batch, rank: int
) -> list[Path]:
    """``--plot DIR`` (rank 0 writes): ``training.png``, the training curve; ``memory.png``,
    every rank's memory by kind, predicted beside measured (over one more step,
    ``measure_step_memory``, after the summary's numbers and the sample are taken; a
    pipeline's is not measured); ``timeline.png`` with pipeline stages: the last training
    step as measured (under the plan's prediction where the job runs a plan)."""
    from plait.comm.checkpoint_io import all_gather_objects
    from plait.planning.plots import loss_figure, timeline_figure, write_png
    from plait.runtime.engine.measure import measure_step_memory
    from plait.runtime.engine.report import plot_memory

    pipeline = job.engine == "pipeline"  # --pp, or a plan's stages
    memory = None if pipeline else measure_step_memory(job, batch)
    report = job.report(memory)  # every rank: a pipeline gathers its timeline here
    reports = all_gather_objects(report)
    if rank != 0:
        return []
    args.plot.mkdir(parents=True, exist_ok=True)
    title = f"TinyGPT on the bundled corpus: mode {summary.mode}, mesh {summary.mesh}"
    figure = loss_figure(summary.losses, first_step=summary.steps_from,
                         eval_losses=summary.eval_losses, title=title)  # fmt: skip
    written = [write_png(figure, args.plot / "training.png")]
    if any(r.memory_columns() for r in reports):
        written.append(plot_memory(reports, args.plot / "memory.png"))
    timelines = [t for t in (report.predicted_timeline, report.measured_timeline) if t]
    if timelines:
        written.append(write_png(timeline_figure(*timelines), args.plot / "timeline.png"))
    return written


def calibrate(args: argparse.Namespace, world_size: int, report: Callable[[str], None]) -> str:
    """``--calibrate``: make this machine's calibration the profile the run plans with
    (:mod:`plait.demo.calibration`); the summary's line about it ("" without the flag)."""
    if not (args.calibrate or args.reuse_calibration):
        return ""
    if args.plan is not None:
        report("--calibrate: a plan file carries the prediction made when it was planned: "
               "not calibrating")  # fmt: skip
        return ""
    if world_size < 2 or not makes_plan(args):
        report("--calibrate: this run makes no plan on several processes, so nothing is "
               "predicted: not calibrating")  # fmt: skip
        return ""
    from plait.demo.calibration import calibrate_for_run

    calibration = calibrate_for_run(world_size, reuse=args.reuse_calibration)
    report(calibration.message())
    how = "reused" if calibration.reused else f"measured in {calibration.seconds:.1f} s"
    return f"local, calibrated ({how}: {calibration.path})"


def generate(job: plait.Job, corpus: Corpus, args: argparse.Namespace) -> str:
    """``args.sample`` characters the trained model writes after a prompt from the evaluation
    text: each one drawn from the softmax of ``job.predict``'s last logits over the last
    ``--seq`` characters. Every rank gets the same logits and draws with the same seeded
    generator, so every rank writes the same text. A pipeline's stages are built for the
    training batch, so there the window is repeated over that many rows."""
    gen = torch.Generator().manual_seed(args.seed + 2)
    rows = args.batch if args.pp > 1 else 1
    window = corpus.eval[: args.seq].tolist()
    prompt_len = len(window)
    for _ in range(args.sample):
        ids = torch.tensor(window[-args.seq :]).unsqueeze(0).expand(rows, -1).contiguous()
        logits = job.predict((ids,))[0, -1]
        window.append(int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)))
    return "".join(corpus.chars[i] for i in window[prompt_len:])


class GeneratorState:
    """The batch generator as a checkpointable object (its position in the batch sequence)."""

    def __init__(self, gen: torch.Generator) -> None:
        self.gen = gen

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"state": self.gen.get_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.gen.set_state(state["state"])


def checkpoints(args: argparse.Namespace, world_size: int) -> Checkpoints | None:
    """Periodic checkpoints as the flags say (None without --save-every or --resume)."""
    if not (args.save_every or args.resume):
        return None
    if args.mode == "stand_alone" and detect_environment().world_size > 1:
        raise SystemExit(
            "--save-every/--resume with --mode stand_alone under several processes: every "
            "process trains its own model and they would write one directory; run one process"
        )
    # A huge interval when only resuming: maybe_save never fires.
    return Checkpoints(args.checkpoint_dir, every=args.save_every or 1 << 62, keep=args.keep)


def _plan_line(job: plait.Job, step_seconds: Sequence[float]) -> str:
    """The plan a planned job ran: searcher, predicted and measured step time (the median
    step after the first, which builds caches and the optimizer's states, as
    ``job.report()`` measures it)."""
    plan = getattr(job.loss_fn, "plan", None)
    if plan is None:
        return ""
    split = sum(op.label != "replicate" for op in plan.ops)
    predicted = plan.predicted.step_time_s
    hardware = f"{plan.hardware!r}" + (f" ({UNCALIBRATED})" if plan.hardware_uncalibrated else "")
    timed = list(step_seconds[1:] or step_seconds)
    measured = statistics.median(timed)
    ratio = f", {measured / predicted:.2f}x the prediction" if predicted else ""
    return (
        f"{plan.search}: {split} of {len(plan.ops)} ops split, predicted "
        f"{predicted * 1e3:.1f} ms/step on hardware {hardware}, measured "
        f"{measured * 1e3:.1f} ms/step (median of {len(timed)} steps{ratio})"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the example; 0 if the training loss fell, 1 otherwise."""
    args = parse_args(argv)
    rank = detect_environment().rank
    configure_logging(args.log_level, rank)
    summary = train(args)
    report = print if rank == 0 else logger.info
    report(summary.text())
    if not summary.loss_fell:
        report(f"FAILED: the training loss did not fall ({summary.first_loss:.4f} -> "
               f"{summary.last_loss:.4f})")  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
