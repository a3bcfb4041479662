"""Moved to bench/harness/vllm_model.py (benchmark harness, which tests may import). This alias
stays until tests/workers/engine/ and tests/support/vllm_soak.py import it from there."""

import sys

from bench.harness import vllm_model

sys.modules[__name__] = vllm_model
