"""`python -m dgstream.infra.kafka.broker fetch|start|stop|status` (what `make kafka-jars` runs)."""

import sys

from dgstream.infra.kafka.broker.cli import main

sys.exit(main())
