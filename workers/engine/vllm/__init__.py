"""vLLM 0.33 as the engine: DiffusionGemma single-step reads, in-process or over HTTP.

One module per job:

- `settings`: the engines' settings (`VllmSettings`, `VllmRemoteSettings`);
- `sizing`: what the settings come to on a model and a card (`check_model`, graph sizes,
  the card's memory);
- `args`: what the in-process engine hands vLLM (`engine_args`, `serve_command`, the read
  path that runs here, the caches' folder);
- `codec`: a read as a vLLM request and back (`build_sampling_params`, `parse_output`,
  `build_completion_body`, `parse_completion`, `check_row`, `settle`);
- `engine`: the in-process engine (`VllmEngine`);
- `remote`: the remote engine (`VllmRemoteEngine`).

The read path inside vLLM is `workers.engine.vllm_reads` (a vLLM plugin); what its features
need of an engine is `workers.engine.vllm_reads.rules`.
"""
