"""The README's walk-through, run as written, once, in page order: its blocks marked
`<!-- walkthrough: readme -->`, and docs/operations.md's log example
(`<!-- walkthrough: readme-logs -->`) while the worker still runs. Each command runs as a
subprocess from the repository root; what it prints is compared with what the page shows
(tests/doc_blocks.py's `matches`: spacing, `...`, ids, rates, numbers within a tolerance).

What differs from a person's terminal, on purpose, and nothing else:

- The broker: `dgstream broker start` runs with `DGSTREAM_KAFKA_HOME` a directory of this
  test, so any broker of the machine's own is left alone; it takes 127.0.0.1:9092 when
  free, else another port. Where it did, `127.0.0.1:9092` on the page (the topology's
  `bootstrap_servers`, the commands' stderr) stands for its address, and the page's
  `.cache/kafka/run` for its directory.
- Ray: the `export RAY_AUTH_...` and `ray start` lines are this test's own cluster
  (bench/harness/ray_cluster.py: token authentication, a temp dir and free ports of its
  own); the commands find it by `RAY_ADDRESS`. `ray stop` is not run: it stops every Ray
  of the user's on the machine (others run here); the cluster is stopped after the test.
- The topology: `topology/examples/jev-routes.yaml` is a copy pointing at the broker above
  (the same file but for `bootstrap_servers`); `/tmp/ray/session_latest` is the cluster's
  session folder.
- Terminal 1 is `dgstream run` in the background; its output is compared once what the
  page shows has appeared, and Ctrl-C is a SIGINT to it. Lines of `dgstream tail` are
  compared in any order (the partitions interleave differently from run to run); the
  record `tail --max 1 --json` prints may be any of its topic's, and is compared with the
  one whose answers the page shows. `dgstream status`'s figures (throughput, lag) are live:
  only its text is compared.
- Logs: each JSON line shown must be in the worker's log with the same keys and values,
  but for `actor_id` and `timestamp`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml
from doc_blocks import ROOT, Block, blocks, json_subset, matches, matches_any_order, transcript

from bench.harness.waiting import wait_for

pytestmark = [pytest.mark.broker, pytest.mark.ray, pytest.mark.model, pytest.mark.slow]

README = ROOT / "README.md"
OPERATIONS = ROOT / "docs" / "operations.md"
EXAMPLE = "topology/examples/jev-routes.yaml"
PAGE_BROKER = "127.0.0.1:9092"
# Not run, and why (the module docstring).
NOT_RUN = {"ray": "the test's own Ray cluster instead", "export": "the test's own Ray token"}


class Terminal1:
    """The long-running command, in the background; its output read as it comes."""

    def __init__(self, line: str, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            ["bash", "-c", line],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.out: list[str] = []
        self._lock = threading.Lock()
        for stream in (self.proc.stdout, self.proc.stderr):
            threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream: Any) -> None:
        for line in stream:
            with self._lock:
                self.out.append(line)

    def text(self) -> str:
        with self._lock:
            return "".join(self.out)

    def interrupt(self) -> int:
        os.killpg(self.proc.pid, signal.SIGINT)
        return self.proc.wait(300)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


class Walk:
    def __init__(self, tmp: Path, cluster: Any) -> None:
        self.home = tmp / "kafka"
        self.cluster = cluster
        self.topology = tmp / "jev-routes.yaml"
        self.broker = PAGE_BROKER
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("DGSTREAM_KAFKA_")},
            "PYTHONPATH": str(ROOT),
            "DGSTREAM_KAFKA_HOME": str(self.home),
            "RAY_ADDRESS": cluster.address,
        }
        self.terminal1: Terminal1 | None = None
        self.session = Path(cluster.temp_dir) / "session_latest"

    # ------------------------------------------------------------------ the page's text

    def localise(self, text: str) -> str:
        """The page's command or code as it runs here."""
        text = text.replace(EXAMPLE, str(self.topology))
        return text.replace("/tmp/ray/session_latest", str(self.session))

    def as_page(self, printed: str) -> str:
        """What a command printed, in the page's terms."""
        printed = printed.replace(self.broker, PAGE_BROKER).replace(str(self.topology), EXAMPLE)
        return printed.replace(str(self.home), str(ROOT / ".cache" / "kafka" / "run"))

    # ------------------------------------------------------------------ running

    def run(self, line: str, timeout: float = 180) -> str:
        done = subprocess.run(
            ["bash", "-c", self.localise(line)],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        printed = self.as_page(done.stdout + done.stderr)
        assert done.returncode == 0, f"{line}: exit {done.returncode}\n{printed[-3000:]}"
        return printed

    def script(self, block: Block) -> None:
        """A block of commands (no prompts): the broker, Ray, `dgstream run` (terminal 1)."""
        _, commands = transcript(block.text)
        for c in commands:
            prog = c.words[0].rsplit("/", 1)[-1]
            if prog in NOT_RUN or (c.words[0].startswith("RAY_") and "ray" in c.line):
                continue
            if c.words[-2:-1] == ["run"]:
                self.write_topology()
                self.terminal1 = Terminal1(self.localise(c.line), self.env)
                continue
            self.run(c.line)
            if c.words[-2:] == ["broker", "start"]:
                self.broker = self.started_broker()

    def started_broker(self) -> str:
        st = json.loads(self.run(".venv/bin/dgstream broker status --json").splitlines()[0])
        servers: str = st["bootstrap"]
        return servers

    def write_topology(self) -> None:
        doc = yaml.safe_load((ROOT / EXAMPLE).read_text())
        doc["kafka"]["bootstrap_servers"] = [self.broker]
        self.topology.write_text(yaml.safe_dump(doc, sort_keys=False))

    def terminal1_shows(self, shown: Block) -> None:
        assert self.terminal1 is not None, f"{shown.where}: no command in terminal 1"
        t1 = self.terminal1

        def there() -> bool:
            assert t1.proc.poll() is None, f"dgstream run exited:\n{t1.text()[-3000:]}"
            return matches(shown.text, self.as_page(t1.text())) is None

        try:
            wait_for(there, 420, f"what {shown.where} shows", every_s=1.0)
        except pytest.fail.Exception:
            # What it did show, for the report (a timeout says nothing of where it stopped).
            print(f"terminal 1 so far:\n{t1.text()[-3000:]}")
            raise

    def transcript(self, block: Block) -> None:
        _, commands = transcript(block.text)
        for c in commands:
            prog = c.words[0].rsplit("/", 1)[-1]
            if prog in NOT_RUN:
                continue
            printed = self.run(c.line)
            self.compare(c.words, "\n".join(c.output), printed, block)

    def compare(self, words: list[str], shown: str, printed: str, block: Block) -> None:
        if not shown.strip():
            return
        where = f"{block.where}: $ {' '.join(words)}"
        if "tail" in words and "--json" in words:
            self.compare_json_record(words, shown, printed, where)
            return
        if "tail" in words:
            why = matches_any_order(shown, printed)
        else:
            why = matches(shown, printed, numbers="status" not in words)
        assert why is None, f"{where}: {why}"

    def compare_json_record(self, words: list[str], shown: str, printed: str, where: str) -> None:
        records = [ln for ln in printed.splitlines() if ln.startswith("{")]
        assert len(records) == 1, f"{where}: {printed}"
        topic = words[words.index("tail") + 1]
        every = self.run(f".venv/bin/dgstream tail {topic} --from-beginning --json --idle-s 2")
        candidates = [json.loads(ln) for ln in every.splitlines() if ln.startswith("{")]
        assert json.loads(records[0]) in candidates
        whys = [json_subset(json.loads(shown), c) for c in candidates]
        assert None in whys, f"{where}: none of {topic}'s records is the one shown: {whys}"

    def python(self, block: Block, shown: Block) -> None:
        """The client, with this environment's Python (the venv's)."""
        done = subprocess.run(
            [sys.executable, "-"],
            input=self.localise(block.text),
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert done.returncode == 0, f"{block.where}: exit {done.returncode}\n{done.stderr[-3000:]}"
        why = matches(shown.text, self.as_page(done.stdout))
        assert why is None, f"{shown.where}: {why}"

    def logs(self, commands: Block, shown: Block) -> None:
        _, lines = transcript(commands.text)
        printed = ""
        for c in lines:
            printed = self.run(c.line)
        got = [json.loads(ln) for ln in printed.splitlines() if ln.startswith("{")]
        for want in (json.loads(ln) for ln in shown.text.splitlines() if ln.strip()):
            fixed = {k: v for k, v in want.items() if k not in ("actor_id", "timestamp")}
            whys = [json_subset(fixed, g) for g in got]
            assert None in whys, f"{shown.where}: no log line like {want}: {whys[:3]}"

    def stop(self, shown: Block) -> None:
        assert self.terminal1 is not None
        rc = self.terminal1.interrupt()
        printed = self.as_page(self.terminal1.text())
        assert rc == 0, printed[-3000:]
        why = matches(shown.text, printed)
        assert why is None, f"{shown.where}: {why}"


def _steps(page: Path, name: str) -> list[Block]:
    return [b for b in blocks(page) if b.directive == "walkthrough" and b.argument == name]


def test_the_readme_walkthrough_runs_as_written(tmp_path: Path) -> None:
    from bench.harness.ray_cluster import ray_cluster

    steps = _steps(README, "readme")
    logs = _steps(OPERATIONS, "readme-logs")
    kinds = [b.kind for b in steps]
    # The shape this test knows: start (terminal 1) and what it prints, the commands of
    # terminal 2, the client and what it prints, Ctrl-C and what it prints, the stop.
    assert kinds == ["sh", "output", "sh", "sh", "python", "output", "output", "sh"], (
        f"the README's walk-through changed shape ({kinds}): teach this test the new steps"
    )
    assert [b.kind for b in logs] == ["sh", "output"], "docs/operations.md's log example"
    with ray_cluster([{"num_cpus": 2}], namespace="dgstream") as cluster:
        walk = Walk(tmp_path, cluster)
        try:
            walk.script(steps[0])
            walk.terminal1_shows(steps[1])
            walk.transcript(steps[2])
            walk.transcript(steps[3])
            walk.python(steps[4], steps[5])
            walk.logs(*logs)
            walk.stop(steps[6])
            walk.transcript(steps[7])
        finally:
            if walk.terminal1 is not None:
                walk.terminal1.kill()
            subprocess.run(
                [".venv/bin/dgstream", "broker", "stop", "--delete-data"],
                cwd=ROOT,
                env=walk.env,
                capture_output=True,
                timeout=120,
            )
