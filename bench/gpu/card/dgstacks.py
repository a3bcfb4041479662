"""A sampling profiler of every Python thread, for the host side of a GPU run.

vLLM's torch profiler shows the GPU's kernels and the torch ops, not where the engine core's
Python spends the time between steps; py-spy needs ptrace, which a container may not grant.
This samples `sys._current_frames()` from a thread of the process itself: no privileges, no
extra package, in every process that imports it (the card's sitecustomize does, when
DGSTREAM_STACKS names a directory).

Sampling is on only while the file `<DGSTREAM_STACKS>/row` exists; its text labels the
samples (the benchmark writes the row's name there around its timed loop). Each process
rewrites `stacks-<pid>.json` every 2 s: {label: {thread: {collapsed stack: samples}}}.

An in-process sampler needs the GIL to read the frames, so a thread is seen where it lets
the GIL go. Left at that, the samples pile up on the calls that release it (a torch op, a
copy, a sleep) and miss pure-Python work (a scheduler) that runs up to the switch
interval (5 ms) before yielding: on the CPU (`bench/stacks_bias.py`), a call taking 5% of
a loop drew every sample. So the sampler takes the frames at once on waking, wakes at
jittered times (a fixed period locks onto the sampled loop's release points), and sets
the process's switch interval to `SWITCH_S`, after which a Python thread yields the GIL
at its next bytecode.

    python bench/gpu/card/dgstacks.py DIR [--top N]   # the report: per row and thread, the
                                                     # lines most often on top, and the
                                                     # functions most often on the stack
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from types import FrameType

# 5 ms: about 100 samples per batch of the rows profiled (0.3-1 s each), and one GIL hand-off
# per tick costs the sampled threads little (a stat and a dict walk). The mean: each wait
# is drawn from 0.5-1.5 of it.
INTERVAL_S = 0.005
# The switch interval while sampling (Python's default is 5 ms): the bias measured on the
# CPU with bench/stacks_bias.py (docs/benchmarks.md, "The host sampler") fell the most from
# the default to 0.1 ms and little below; a thread holding the GIL without contention
# never checks it, so only the sampler's ticks pay.
SWITCH_S = 0.0001
DEPTH = 40  # frames kept per stack, innermost first: enough to reach vLLM's busy loop


def _collapse(frame: FrameType | None) -> str:
    names: list[str] = []
    while frame is not None and len(names) < DEPTH:
        code = frame.f_code
        names.append(f"{Path(code.co_filename).name}:{code.co_name}:{frame.f_lineno}")
        frame = frame.f_back
    return ";".join(reversed(names))


def start(directory: str, *, switch_s: float | None = SWITCH_S, jitter: bool = True) -> None:
    """Sample every thread of this process into `directory` while its row flag exists.
    `switch_s` None leaves Python's switch interval, and `jitter` False wakes every
    INTERVAL_S: the sampler as it was before 2026-12-05 (night), for comparison only."""
    if switch_s is not None:
        sys.setswitchinterval(switch_s)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    flag = out / "row"
    path = out / f"stacks-{os.getpid()}.json"
    samples: dict[str, dict[str, Counter[str]]] = defaultdict(lambda: defaultdict(Counter))

    def write() -> None:
        if not samples:
            return
        # One temporary name per writer: the sampler and the exit hook may both write.
        tmp = path.with_suffix(f".{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps({k: dict(v) for k, v in samples.items()}))
        os.replace(tmp, path)

    def read_label() -> str:
        try:
            return flag.read_text().strip()
        except OSError:
            return ""

    def loop() -> None:
        me = threading.get_ident()  # the sampler leaves itself out
        last = time.monotonic()
        label = read_label()
        while True:
            time.sleep(INTERVAL_S * (0.5 + random.random()) if jitter else INTERVAL_S)
            # The frames first, walked at once: any other call here (the flag's read is
            # file I/O) lets the GIL go and waits for it again, and the sampled threads
            # run on to their next release point in between; the frames are live objects,
            # so they are read before that too.
            taken = (
                [(i, _collapse(f)) for i, f in sys._current_frames().items() if i != me]
                if label
                else []
            )
            now = read_label()
            # Counted only if the row held the same label before the wait and after the
            # frames (a loaded host preempts this thread anywhere), so no work before or
            # after the row is ever counted.
            if label and now == label:
                names = {t.ident: t.name for t in threading.enumerate()}
                for ident, stack in taken:
                    samples[label][names.get(ident, str(ident))][stack] += 1
            label = now
            if time.monotonic() - last > 2:
                last = time.monotonic()
                try:
                    write()
                except Exception:  # the process is going away
                    return

    import atexit

    atexit.register(write)
    threading.Thread(target=loop, daemon=True, name="dgstacks").start()


def report(directory: str, top: int = 25) -> str:
    """Per row, process and thread: how often each line was innermost (self) and each
    function anywhere on the stack (inclusive), as shares of the thread's samples."""
    lines: list[str] = []
    for path in sorted(Path(directory).glob("stacks-*.json")):
        data = json.loads(path.read_text())
        for label, threads in sorted(data.items()):
            for thread, stacks in sorted(threads.items(), key=lambda kv: -sum(kv[1].values())):
                total = sum(stacks.values())
                if total < 20:  # a thread that barely ran while sampled
                    continue
                own: Counter[str] = Counter()
                inclusive: Counter[str] = Counter()
                for stack, n in stacks.items():
                    frames = stack.split(";")
                    own[frames[-1]] += n
                    for f in set(":".join(x.split(":")[:2]) for x in frames):
                        inclusive[f] += n
                lines.append(f"== {path.stem} row {label} thread {thread}: {total} samples")
                lines.append("  self (innermost line):")
                lines += [f"    {100 * n / total:5.1f}%  {f}" for f, n in own.most_common(top)]
                lines.append("  inclusive (function on the stack):")
                lines += [
                    f"    {100 * n / total:5.1f}%  {f}" for f, n in inclusive.most_common(top)
                ]
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="report the samples of a run")
    ap.add_argument("directory")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    print(report(a.directory, a.top))
