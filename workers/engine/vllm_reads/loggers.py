"""The read path's loggers, in one namespace under vLLM's. (Not `log`: the package's own
logger has that name.)"""

from __future__ import annotations

from vllm.logger import _VllmLogger, init_logger

# Under vLLM's logger, so the lines reach vLLM's log handler in the engine core process:
# a logger outside `vllm.` has none there, and its info lines are dropped.
NAMESPACE = "vllm.dgstream_reads"


def reads_logger(module: str) -> _VllmLogger:
    """The logger of the read path's `module` (model, sampler, scheduler, graphs), with
    vLLM's helpers (`info_once`, `warning_once`)."""
    return init_logger(f"{NAMESPACE}.{module}")


__all__ = ["NAMESPACE", "reads_logger"]
