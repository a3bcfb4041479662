"""Moved to bench/harness/nvfp4.py (benchmark harness, which tests may import). This alias
stays until tests/workers/engine/ and tests/support/vllm_soak.py import it from there."""

import sys

from bench.harness import nvfp4

sys.modules[__name__] = nvfp4
