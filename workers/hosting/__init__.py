"""Hosting: the stream worker's facade (`worker`), its Ray actor (`actor`), its settings,
status, metrics and logs.
"""
