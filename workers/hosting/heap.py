"""The worker process's heap: what start-up leaves alive is frozen out of the collector."""

from __future__ import annotations

import gc

__all__ = ["freeze_startup_heap"]


def freeze_startup_heap() -> int:
    """Collect, then move every object alive now (the model's and tokenizer's, the imported
    libraries', the clients') into the collector's permanent generation; returns how many
    are frozen. A full collection walks every tracked object: with torch and transformers
    loaded most of them are start-up's and never die. On the fake engine at zero cost a
    worker in a process of its own answered 20,000 requests at 1,325 and 1,063 results/s
    as it was, 1,434 and 1,531 frozen (11 full collections a run; 2 cores, 2026-12-07).
    Objects that die later are still freed by their reference counts; only cycles among
    frozen ones stay. vLLM's worker freezes its heap after its warm-up for the same
    reason."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
