"""The stream worker's roles, one module each, and the thread that runs it.

- `loop`: the consume loop (the consumer thread: whoever calls `StreamWorker.run()`);
- `intake`: poll sizing, the wait while full, batch filling and parsing (consumer thread);
- `ownership`: the rebalance listener (kafka-python's I/O thread, inside poll()),
  revocation, the rewind of abandoned work, the lag (consumer thread);
- `engine_stage`: classifying and building a batch's outputs (the engine loop's thread);
- `recovery`: the error table's actions and the commit step (consumer thread, listener);
- `delivery`: the producer, sends and commits, at-least-once and exactly-once halves
  (sends on the engine loop, acknowledgements on the producer's I/O thread, commits on
  the consumer thread);
- `shared`: the state, the completion queue and the ports the roles are handed;
- `actions`: the error table.

`workers.hosting.worker.StreamWorker` builds them and is the only public face. Kafka client
workarounds are `workers.kafka.quirks`. docs/architecture.md draws the layout.
"""
