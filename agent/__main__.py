"""`python -m agent`: the same as the `gpu-ready` command."""

import sys

from agent.cli import main

sys.exit(main())
