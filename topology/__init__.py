"""The control plane (pipeline spec, autoscaler, controller) and, in `topology.cli`, the
`dgstream` command."""
