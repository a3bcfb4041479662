"""`python -m dgstream.topology.cli`: the `dgstream` command."""

import sys

from dgstream.topology.cli.app import main

sys.exit(main())
