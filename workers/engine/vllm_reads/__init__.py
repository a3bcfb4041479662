"""dgstream's read path inside vLLM: a vLLM general plugin.

vLLM loads the entry points of the group `vllm.general_plugins` in every process it starts
(front end, engine core, workers), and the project's `pyproject.toml` registers `register`
below as `dgstream_reads`. It is written against vLLM 0.33's DiffusionGemma internals, so it
registers nothing on another version and says so: that vLLM then serves reads its own way.

Registered, it changes nothing until an engine asks: `workers.engine.vllm.args` turns it
on per engine through `additional_config` (`options.CONFIG_KEY`). What it does then is in
`model.py` (unembedding, self-conditioning, admission), `sampler.py` (the step),
`scheduler.py` (one-step reads) and `graphs.py` (FULL graphs for small mixed steps), and
in docs/vllm.md; what each feature needs from an engine is `rules.py`. `VLLM_PLUGINS=""` in
the environment keeps vLLM from loading any plugin.
"""

from __future__ import annotations

import logging
from typing import Any

from dgstream.workers.engine.vllm_reads.options import (
    CONFIG_KEY,
    ENTRY_POINT_GROUP,
    ENTRY_POINT_NAME,
    SUPPORTED_VLLM,
    ReadPathOptions,
)

log = logging.getLogger(__name__)

ARCHITECTURE = "DiffusionGemmaForBlockDiffusion"
MODEL_CLASS = "dgstream.workers.engine.vllm_reads.model:DgDiffusionGemma"

# Why this process serves reads the way it does: None until `register` ran.
_status: str | None = None


def supported(version: str) -> bool:
    """Whether a vLLM version is one the read path was written for (0.33.x)."""
    parts = version.split(".")
    return ".".join(parts[:2]) == SUPPORTED_VLLM and len(parts) >= 2


def register() -> None:
    """The entry point: register the read path's model with vLLM (idempotent: vLLM may
    call it more than once in a process)."""
    global _status
    if _status is not None:
        return
    import vllm

    version = str(vllm.__version__)
    if not supported(version):
        _status = (
            f"stock: vLLM {version} is not {SUPPORTED_VLLM}.x, the version dgstream's read "
            "path is written for; vLLM serves reads its own way"
        )
        log.warning("dgstream read path not registered: %s", _status)
        return
    from vllm import ModelRegistry
    from vllm.model_executor.models import config as model_configs

    ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
    stock_hook = model_configs.MODELS_CONFIG_MAP[ARCHITECTURE]
    model_configs.MODELS_CONFIG_MAP[ARCHITECTURE] = _keep_max_num_seqs(stock_hook)
    _status = f"registered for vLLM {version}"
    from dgstream.workers.engine.vllm_reads import debug

    debug.install()  # inert unless a diagnostics variable is set (debug.py)


def one_step_refusal(vllm_config: Any) -> str | None:
    """Why an engine cannot run one-step reads (None: it can). Read at vLLM's config hook,
    before vLLM picks its own diffusion scheduler, against `rules.ONE_STEP`: the rules the
    engine's settings apply earlier, with the names of the settings."""
    from dgstream.workers.engine.vllm_reads import rules

    found = rules.clashes(rules.ONE_STEP, rules.shape_of_vllm_config(vllm_config))
    return "; ".join(found) or None


def status() -> str | None:
    """What `register` did in this process (None: it has not run)."""
    return _status


def _keep_max_num_seqs(stock_hook: type) -> type:
    """vLLM's DiffusionGemma config hook, then the user's max_num_seqs back for an engine
    with the read path on (the hook lowers any value >= 128 to 8, for its own sampler's
    memory; the read path's step holds one bounded tile)."""

    class KeepMaxNumSeqs(stock_hook):
        @classmethod
        def verify_and_update_config(cls, vllm_config: object) -> None:
            super().verify_and_update_config(vllm_config)
            options = ReadPathOptions.from_additional_config(
                getattr(vllm_config, "additional_config", None)
            )
            scheduler = getattr(vllm_config, "scheduler_config", None)
            if options.enabled and options.max_num_seqs and scheduler is not None:
                scheduler.max_num_seqs = options.max_num_seqs
            if options.enabled and options.one_step and scheduler is not None:
                why = one_step_refusal(vllm_config)
                if why is None:
                    from dgstream.workers.engine.vllm_reads.scheduler import SCHEDULER_CLASS

                    scheduler.scheduler_cls = SCHEDULER_CLASS
                else:
                    log.warning("dgstream one-step reads off: %s; reads take two steps", why)

    KeepMaxNumSeqs.__name__ = KeepMaxNumSeqs.__qualname__ = f"DgReads{stock_hook.__name__}"
    return KeepMaxNumSeqs


__all__ = [
    "ARCHITECTURE",
    "CONFIG_KEY",
    "ENTRY_POINT_GROUP",
    "ENTRY_POINT_NAME",
    "MODEL_CLASS",
    "ReadPathOptions",
    "one_step_refusal",
    "register",
    "status",
    "supported",
]
