"""The demo model's training on the demo task family (the single-step-read objective),
split by job: `questions` (training-only questions), `reads` (examples as the engine reads
them), `data` (the data worker processes), `model` (forward, losses, experts), `check`
(the held-out check and the parity check), `loop` (the run and its command line).
`bench/train_demo_model.py` is its command."""
