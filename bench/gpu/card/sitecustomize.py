"""Every Python process of a GPU run behaves as if its GPU were a small card (the project's
24 GB emulation on a big one). Off unless DGSTREAM_CARD_GIB is set.

Put this directory first on PYTHONPATH (Python imports the first `sitecustomize` it finds
at start-up) and set DGSTREAM_CARD_GIB to the card's size as torch reports it (23.6 for a
24 GB board: 24 x 10^9 bytes less what the board reserves). In each process that uses CUDA,
once CUDA initialises there:

- PyTorch's caching allocator is capped at the card less one CUDA context
  (DGSTREAM_CARD_CONTEXT_GIB, 0.5 by default: what a context plus cuBLAS's workspace took
  on the H200), with `torch.cuda.set_per_process_memory_fraction`;
- `torch.cuda.mem_get_info` and `torch.accelerator.get_memory_info` report the small card:
  total = the card, free = the card less what the whole GPU has in use (every process and
  non-PyTorch allocations too, as on a real card). vLLM sizes its KV cache and its
  sampler's tiles from these, so `gpu_memory_utilization` means what it would on the card;
- with DGSTREAM_CARD_REPORT set to a directory, the process writes its peak memory there
  (`card-<pid>.json`, rewritten every second and at exit: vLLM's engine core may be killed
  rather than exit), with the SM share it runs at (`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`, the
  compute-limited profiles of `profiles.py`) and the SM count the driver reports to it;
- with DGSTREAM_CARD_SHARED=1, several emulated cards share one GPU (engines side by side
  under MPS): "used" is this process's own, PyTorch's reserved memory plus the context,
  instead of the whole GPU's, so one engine's start does not read another's memory as its
  own; what a process holds outside PyTorch is then an estimate
  (DGSTREAM_CARD_SHARED_OUTSIDE_GIB, 0.5 by default, measured).

Nothing happens in a process that never initialises CUDA (the benchmark's driver, vLLM's
front end, Ray's raylet): no context is created here.
"""

import os

_CARD = os.environ.get("DGSTREAM_CARD_GIB")


def _install(card_gib: float) -> None:
    import json
    import sys
    import threading
    import time

    import torch

    gib = 2**30
    card = int(card_gib * gib)
    context = int(float(os.environ.get("DGSTREAM_CARD_CONTEXT_GIB", "0.5")) * gib)
    report_dir = os.environ.get("DGSTREAM_CARD_REPORT")
    true_info = torch.cuda.mem_get_info  # the real card's (free, total)

    shared = os.environ.get("DGSTREAM_CARD_SHARED") == "1"
    # What an engine process held outside PyTorch's allocator beyond the context, counted
    # against its card in shared mode: 0.48 GiB (22.18 GiB in use, 21.70 reserved by
    # PyTorch, an engine core on the H200 on 2026-12-07; docs/data/card24/slow_gpu). Without
    # it three engines' KV caches came out 0.3 GiB larger than on a card of their own and
    # the read path's 1 GiB warmup tile then hit the allocator's cap.
    outside = int(float(os.environ.get("DGSTREAM_CARD_SHARED_OUTSIDE_GIB", "0.5")) * gib)

    def info(device=None):  # torch's own signature
        if shared:
            used = torch.cuda.memory_reserved(device) + context + outside
        else:
            free, total = true_info(device)
            used = total - free
        return (max(0, card - used), card)

    def report() -> None:
        if not report_dir:
            return
        body = {
            "pid": os.getpid(),
            "argv": " ".join(sys.argv[:3])[:200],
            "card_gib": card_gib,
            "allocator_cap_gib": (card - context) / gib,
            "peak_allocated_gib": torch.cuda.max_memory_allocated() / gib,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / gib,
            "gpu_used_gib": (true_info()[1] - true_info()[0]) / gib,
            "shared_gpu": shared,
            "mps_active_thread_percentage": os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
            "sm_count": torch.cuda.get_device_properties(0).multi_processor_count,
            "time": time.time(),
        }
        path = os.path.join(report_dir, f"card-{os.getpid()}.json")
        # One temporary name per writer: the timer and the exit hook may both write.
        tmp = f"{path}.{threading.get_ident()}.tmp"
        with open(tmp, "w") as f:
            json.dump(body, f)
        os.replace(tmp, path)

    def on_cuda_init() -> None:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, (card - context) / total))
        print(
            f"[card] pid {os.getpid()}: a {card_gib} GiB card "
            f"(allocator capped at {(card - context) / gib:.2f} GiB)",
            file=sys.stderr,
            flush=True,
        )
        if report_dir:
            os.makedirs(report_dir, exist_ok=True)
            import atexit

            atexit.register(report)

            def every_second() -> None:
                while True:
                    time.sleep(1)
                    try:
                        report()
                    except Exception:  # the process is going away
                        return

            threading.Thread(target=every_second, daemon=True, name="card-report").start()

    torch.cuda.mem_get_info = info
    torch.cuda.memory.mem_get_info = info
    if hasattr(torch, "accelerator") and hasattr(torch.accelerator, "get_memory_info"):
        torch.accelerator.get_memory_info = info
    # Runs when this process first initialises CUDA (at once if it already has).
    torch.cuda._lazy_call(on_cuda_init)


if _CARD:
    try:
        _install(float(_CARD))
    except Exception as exc:  # a probe of the environment: say so, change nothing
        import sys

        print(f"[card] pid {os.getpid()}: not emulated: {exc!r}", file=sys.stderr, flush=True)

# The host-side sampler (dgstacks.py), in every process, when DGSTREAM_STACKS names a directory.
if os.environ.get("DGSTREAM_STACKS"):
    try:
        import dgstacks

        dgstacks.start(os.environ["DGSTREAM_STACKS"])
    except Exception as exc:
        import sys

        print(f"[card] pid {os.getpid()}: no stack samples: {exc!r}", file=sys.stderr, flush=True)
