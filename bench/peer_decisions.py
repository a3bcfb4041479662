"""The peer of dgstream's vLLM read path: `vllm serve`'s own label reads (`/v1/decisions`, or
`/v1/systemone`) on the full-size DiffusionGemma shape with dummy weights, held at a fixed
concurrency by an async client. The harness is bench/harness/peer_decisions.py.

Run on the GPU machine (bench/gpu/peer_session.sh: the emulated 24 GB card), one server
start, then the rows; render here:

    python3 bench/peer_decisions.py --out peer.json          # GPU machine
    python bench/peer_decisions.py --render docs/data/card24/peer_decisions.json \\
        --beside "stock in-process=docs/data/card24/card_stock.json" --write   # here

What is served, and how:
- the model directory of `bench.engine_vllm.full_size_dir` plus a tokenizer built for
  vLLM's decision routes (the harness's docstring says why and how);
- `vllm serve` with `workers.engine.vllm.args.serve_command`: the in-process engine's own
  settings on vLLM's own read path (only the tokenizer is loaded, which the decision routes
  need), and `VLLM_PLUGINS=""` so that vLLM loads no plugin (dgstream's included). The rest
  of this process's environment (the emulated card's variables) goes to the server as is.

What is measured, per concurrency (1, 32, 256) and kind, on the reads of
`bench.engine_gpu.make_reads` (256-token prompts, a 16-token canvas, 3 questions: yes/no,
a choice of 4, a score of 5):
- `unique`: states that share nothing (fresh ones every request);
- `shared`: one question set: every state starts with the same text and only its last 32
  tokens differ (as the in-process rows' 224-token shared prefix). vLLM's decision prompt
  puts the questions after the state, so the prefix the requests share ends where the
  states differ (the JSON's `shared_prefix_tokens`).
The state's length makes the prompt the engine gets (chat template, state, questions,
vLLM's thought block) exactly `--prompt` tokens. A request is one state and its 3
questions, one joint read (`joint: true`: one 16-token canvas) unless `--no-joint`; the
client keeps `batch` requests in flight, a first round of them as a warm-up, then
`batch x max(3, min(64, 256 // batch))` requests (bench/engine_vllm.py's repeats). A row:
questions/s, reads/s (= states/s, the in-process rows' unit), p50/p99 of each request's
latency (send to last byte), errors: every response is parsed with vLLM's own response model
and checked (one answer per question, probabilities summing to 1).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the repository


from bench.harness.peer_decisions import parse_args, render, run


def model_dir(quant: str, root: Path) -> Path:
    from bench.engine_vllm import full_size_dir

    return full_size_dir(quant, root)


def peak_memory() -> Any:
    """NVML's view of the card (bench.engine_vllm.PeakMemory), or None without NVML."""
    try:
        from bench.engine_vllm import PeakMemory

        return PeakMemory()
    except Exception:  # no pynvml or no NVIDIA driver (a CPU machine)
        return None


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render:
        md = render(Path(args.render), args.beside, args.section, args.date)
        if args.write:
            from bench.report import write_section

            write_section(args.section, md)
        print(md)
        return 0
    result = run(args, model_dir, peak_memory)
    return 0 if result["complete"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
