"""`python -m plait ...` is the `plait` command."""

import sys

from plait.cli import main

sys.exit(main())
