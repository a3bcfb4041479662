"""A sampling profiler of every Python thread, for the host side of a GPU run.

vLLM's torch profiler shows the GPU's kernels and the torch ops, not where the engine core's
Python spends the time between steps; py-spy needs ptrace, which a container may not grant.
This samples `sys._current_frames()` from a thread of the process itself: no privileges, no
extra package, in every process that imports it (the card's sitecustomize does, when
DGSTREAM_STACKS names a directory).

Sampling is on only while the file `<DGSTREAM_STACKS>/row` exists; its text labels the
samples (the benchmark writes the row's name there around its timed loop). Each process
rewrites `stacks-<pid>.json` every 2 s: {label: {thread: {collapsed stack: samples}}}.

    python bench/gpu/card/dgstacks.py DIR [--top N]   # the report: per row and thread, the
                                                     # lines most often on top, and the
                                                     # functions most often on the stack
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from types import FrameType

# 5 ms: about 100 samples per batch of the rows profiled (0.3-1 s each), and one GIL hand-off
# per tick costs the sampled threads little (a stat and a dict walk).
INTERVAL_S = 0.005
DEPTH = 40  # frames kept per stack, innermost first: enough to reach vLLM's busy loop


def _collapse(frame: FrameType | None) -> str:
    names: list[str] = []
    while frame is not None and len(names) < DEPTH:
        code = frame.f_code
        names.append(f"{Path(code.co_filename).name}:{code.co_name}:{frame.f_lineno}")
        frame = frame.f_back
    return ";".join(reversed(names))


def start(directory: str) -> None:
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
        while True:
            time.sleep(INTERVAL_S)
            label = read_label()
            if label:
                names = {t.ident: t.name for t in threading.enumerate()}
                taken = [
                    (names.get(ident, str(ident)), _collapse(frame))
                    for ident, frame in sys._current_frames().items()
                    if ident != me
                ]
                # The row may end between reading the flag and taking the frames (a loaded
                # host preempts this thread there): a sample counts only if the flag still
                # holds the same label after it, so no work after the row is ever counted.
                if read_label() == label:
                    for thread, stack in taken:
                        samples[label][thread][stack] += 1
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
