"""`python -m topology.cli`: the `dgstream` command."""

import sys

from topology.cli.app import main

sys.exit(main())
