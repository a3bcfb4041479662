"""The demo model's training on the demo task family (the single-step-read objective),
split by job: `questions` (training-only questions), `reads` (examples as the engine reads
them), `data` (the data worker processes), `model` (forward, losses, experts), `check`
(the held-out check and the parity check), `loop` (the run and its command line); and its
probes (`attention_entropy`, `slot_attention`, `slot_lens`). `bench/train_demo_model.py` is
its command. A dev tool, not shipped (the wheel holds the task family, `topology.demo_tasks`,
which this imports like any other user); library code of bench/ like `bench/harness/`: tests
import it, and it imports no benchmark script."""
