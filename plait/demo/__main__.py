"""Launch the demo job: ``plait run --worker-num 4 -m plait.demo.train``."""

import sys

from plait.cli import main

if __name__ == "__main__":
    argv = [
        "run",
        "--worker-num",
        "4",
        "--tail-worker-log",
        "0",
        "-m",
        "plait.demo.train",
        *sys.argv[1:],
    ]
    sys.exit(main(argv))
