"""Faults: the worker's own failures (`errors`), outages of the engine or the output topic
(`outage`), poison records (`poison`) and record batches a poll cannot read
(`poll_errors`). What each makes the worker do is one table: `workers.stream.actions`.
"""
