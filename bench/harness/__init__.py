"""The benchmarks' harnesses as library code: what a benchmark script (`bench/*.py`) runs and
the tests check on the CPU or run as their own tier.

- `fault_matrix`: faults x deliveries on real brokers, each cell against an oracle;
  `worker_process` hosts one worker in a process of its own for it.
- `peer_decisions`, `card_rows`: the vLLM peer's and the GPU card's rows and sections;
  `figures`: the figure markers those sections define and other pages quote.
- `pipeline` (topics, requests, readers, worker threads), `faults` (fake engines, group and
  topic faults), `waiting`: the test pipeline the broker tiers and the benchmarks drive.
- `spike`, `ray_cluster`: the autoscaler's spike scenario on Ray clusters of our own.
- `bombs`, `reads`, `miswire`, `nvfp4`, `sampler_bias`, `vllm_frontend`, `vllm_model`,
  `vllm_scheduler`: the smaller harnesses (bench/<name>.py or its caller says which).

It imports the product and itself, never a script of bench/ nor anything of tests/
(tests/repo/test_layers.py).
"""
