"""The stream's steps: what the worker does to a batch, in order: read each record's value
(`inputs`), answer the batch (`classify`), build one output per record (`outputs`, with
`records` for keys and headers and `topics` for where and how large), and the types that
travel between the threads (`batches`). `workers/stream/` runs them.
"""
