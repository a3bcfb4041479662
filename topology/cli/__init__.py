"""The `dgstream` command line: the parser and its subcommands, apart from the control plane.

- `app`: the parser, `main`, and the subcommands that talk to a deployment (`run`,
  `status`, `stop`) or answer locally (`ask`); `broker` hands over to `infra.kafka.broker`;
- `commands`: the Kafka-facing subcommands (`produce`, `tail`, `dlq`) and what every Kafka
  command shares (`Refused`, the connection arguments);
- `decisions`: `calibrate` and `compare`;
- `skip_batch`: `skip-batch`;
- `demo`: `dgstream demo`.

The control plane (`topology.spec`, `topology.controller`, `topology.autoscaler`, ...) never
imports this package (`tests/repo/test_layers.py` checks it); `python -m dgstream.topology.cli` is
the `dgstream` command.
"""

from dgstream.topology.cli.app import build_parser, main

__all__ = ["build_parser", "main"]
