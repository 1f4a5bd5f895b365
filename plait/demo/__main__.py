"""``make demo``: the GPT example on 4 local workers, Megatron dp=2 x tp=2.

Runs ``plait run --worker-num 4 -m plait.demo.train --mode semi_auto --tp 2 --calibrate``;
extra arguments go to the example (``python -m plait.demo --steps 300``). ``--calibrate``: the
workers first measure this machine for a few seconds (:mod:`plait.demo.calibration`), so the
summary's predicted step time is this machine's as it is now
(``python -m plait.demo --reuse-calibration`` plans on the last one instead). The example's code lives in ``plait.demo.train`` so that the demo works from an
installed plait; ``examples/gpt/train.py`` runs the same code as a script.
"""

import sys

from plait.cli import main

DEMO_ARGS = ("--mode", "semi_auto", "--tp", "2", "--calibrate")


def demo_argv(extra: list[str]) -> list[str]:
    """The ``plait run`` command line of the demo, with ``extra`` passed to the example."""
    return ["run", "--worker-num", "4", "--tail-worker-log", "0",
            "-m", "plait.demo.train", *DEMO_ARGS, *extra]  # fmt: skip


if __name__ == "__main__":
    sys.exit(main(demo_argv(sys.argv[1:])))
