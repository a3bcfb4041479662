"""Test support: what the tests share with the benchmarks (a Ray cluster of their own, the
autoscaling spike scenario). Benchmarks import from here or from the product; the product
never imports it, and no test imports `bench/`."""
