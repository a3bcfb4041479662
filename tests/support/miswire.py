"""Moved to bench/harness/miswire.py (benchmark harness, which tests may import). This alias
stays until tests/workers/engine/ and tests/support/vllm_soak.py import it from there."""

import sys

from bench.harness import miswire

sys.modules[__name__] = miswire
