"""Pipeline spec, autoscaler, controller and the `dgstream` command."""
