"""The GPT example: a character-level GPT trained on plait's bundled corpus, in any built mode.

    plait run --worker-num 4 examples/gpt/train.py --mode semi_auto --tp 2
    plait run --worker-num 4 examples/gpt/train.py --mode data_parallel
    python examples/gpt/train.py --mode stand_alone

The program is ``plait.demo.train`` (what ``make demo`` runs): it ships inside the plait package
with its corpus, so the demo works from an installed plait, and this script runs the same code.
See examples/gpt/README.md for the flags and what a run prints.
"""

import sys

from plait.demo.train import main

if __name__ == "__main__":
    sys.exit(main())
