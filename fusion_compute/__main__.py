"""`python -m fusion_compute ...` is the `fusion` command (local workers are started this way)."""

import sys

from .cli.main import main

sys.exit(main())
