"""The fault matrix: faults x {at_least_once, exactly_once} on real brokers, each cell
checked against an oracle.

One cell: a pipeline (6 input partitions, 3 output, 1 dead-letter; on the 3-broker KRaft
cluster replication 3 and min.insync.replicas 2), two workers on the fake engine (with a
cost per read, so that batches are in flight when the fault comes), requests produced at
a steady rate, the fault a third of the way in, and every worker that dies restarted at
once, as Ray restarts its actor. A cell passes when:

- every input id is answered or dead-lettered (dead letters only where the fault makes
  them: the poison cell's records, each with its own code), and each result holds the fake
  engine's own answers for THAT request (recomputed here), so swapped results fail;
- exactly-once, read with read_committed: no id twice; at-least-once: at most
  `faults x workers touched x max_in_flight x max_records` duplicates (docs/operations.md);
- the group's committed offsets reach the input's end offsets.

Time to recover: from the fault's end (a node back and answering, a frozen process
thawed; a kill or a deletion ends at once) to the last result that came late (more than
`LATE_S` after its request was produced); 0 when none did.

    PYTHONPATH=. .venv/bin/python bench/fault_matrix.py --write    # the whole matrix
    PYTHONPATH=. .venv/bin/python bench/fault_matrix.py --brokers single --faults kill9

It starts its own brokers, prints the table, and with `--write` rewrites the
"fault-matrix" section of docs/benchmarks.md. The CI tier (tests/workers/test_fault_matrix.py)
runs some of the same cells, smaller; DGSTREAM_FAULT_MATRIX=full runs them all there.

Every fault of the list runs on both brokers where it means something; the one left out:
a partition leader kill -9 on the single broker is the whole cluster down and back (the
broker restart's row, without the controlled shutdown), so it runs on the cluster only.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the repository


from bench.harness.fault_matrix import (
    BATCHING,
    BROKERS,
    COST_PER_READ_S,
    DELIVERIES,
    FAULTS,
    LATE_S,
    BrokerKind,
    Size,
    Verdict,
    run_cell,
    running_brokers,
)

# --------------------------------------------------------------------------- the report

COLUMNS = [
    "brokers",
    "fault",
    "delivery",
    "messages",
    "lost",
    "duplicates",
    "wrong answers",
    "dead letters",
    "restarts",
    "fault (s)",
    "recovered (s)",
    "cell (s)",
    "",
]


def table(verdicts: list[Verdict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(v.row()) + " |" for v in verdicts]
    return "\n".join(lines)


def section(verdicts: list[Verdict], size: Size, command: str, wall_s: float) -> str:
    return f"""## Fault matrix: faults x delivery guarantees, one broker and a 3-broker cluster

`{command}` ({time.strftime("%Y-%m-%d")}, this 2-core machine, {wall_s / 60:.0f} min in all):
{size.messages} requests a cell, produced over {size.seconds:g} s, the fault when a third of
them is in; {size.workers} workers on the fake engine ({COST_PER_READ_S * 1000:g} ms a read,
batches of {BATCHING["max_records"]}, {BATCHING["max_in_flight"]} in flight); the cluster has
replication 3 and min.insync.replicas 2 on the pipeline's topics. *Lost*: ids neither
answered nor dead-lettered; *duplicates*: results past the first (exactly-once read with
read_committed), with the at-least-once bound in brackets (faults x workers touched x
max_in_flight x max_records); *wrong answers*: results unlike the fake engine's own
answers for that request; *fault*: how long it lasted (a restarted node: until it answers
again); *recovered*: from the fault's end to the last result that came more than
{LATE_S:g} s after its request. Every cell also checks that the group's committed offsets
reach the end offsets.

{table(verdicts)}
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=240)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--brokers", default=",".join(BROKERS))
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--deliveries", default=",".join(DELIVERIES))
    parser.add_argument(
        "--write", action="store_true", help="rewrite docs/benchmarks.md's fault-matrix section"
    )
    args = parser.parse_args(argv)
    size = Size(args.messages, args.seconds)
    faults = args.faults.split(",")
    verdicts: list[Verdict] = []
    t0 = time.monotonic()
    for name in args.brokers.split(","):
        if name not in BROKERS:
            parser.error(f"--brokers: {name!r} is none of {', '.join(BROKERS)}")
        kind: BrokerKind = "single" if name == "single" else "cluster"
        with (
            tempfile.TemporaryDirectory(prefix=f"matrix-{kind}-") as home,
            running_brokers(kind, home) as brokers,
        ):
            for fault in faults:
                if kind not in FAULTS[fault].brokers:
                    continue
                for delivery in args.deliveries.split(","):
                    v = run_cell(brokers, fault, delivery, size)
                    verdicts.append(v)
                    print(" | ".join(v.row()), *v.problems(), flush=True)
    wall = time.monotonic() - t0
    print(table(verdicts))
    command = "PYTHONPATH=. .venv/bin/python bench/fault_matrix.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    if args.write:
        from bench.report import write_section

        write_section("fault-matrix", section(verdicts, size, command.strip(), wall))
    return 0 if all(not v.problems() for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
