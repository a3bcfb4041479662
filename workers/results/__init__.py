"""The per-result glue: what the worker adds to each answer besides the answer, on one
per-record context (`decisions`): calibration, the audit block, and traces.
"""
