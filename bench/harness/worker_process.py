"""One StreamWorker in a process of its own, for tests that need a worker process to die
(crash, kill -9, SIGSTOP): `python bench/harness/worker_process.py SETTINGS_JSON [ENGINE]`.

ENGINE: "fake" (the default), or "exit-on:PREFIX:CODE" (the process exits with CODE the
moment the engine reads a request whose id starts with PREFIX). Exits 0 after a drain on
SIGTERM, 70 when the worker failed (as the Ray actor does).
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

# Run as a file, this process has the repository (bench.harness, the packages) on its path.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.harness.faults import CrashOn, classifier_with
from dgstream.workers.hosting.settings import WorkerSettings
from dgstream.workers.hosting.worker import StreamWorker, WorkerFailed


def main() -> int:
    settings = WorkerSettings.model_validate_json(sys.argv[1])
    engine = sys.argv[2] if len(sys.argv) > 2 else "fake"
    classifier = None
    if engine.startswith("exit-on:"):
        _, prefix, code = engine.split(":")
        classifier, _ = classifier_with(
            lambda inner: CrashOn(inner, prefix, exit_code=int(code)), settings
        )
    worker = StreamWorker(settings, classifier=classifier)
    # drain() waits for run() to return, which runs on this thread: ask from another.
    signal.signal(
        signal.SIGTERM, lambda *_: threading.Thread(target=worker.drain, daemon=True).start()
    )
    try:
        worker.run()
    except WorkerFailed:
        return 70
    return 0


if __name__ == "__main__":
    sys.exit(main())
