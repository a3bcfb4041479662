"""vLLM 0.33's front end on the CPU, one read at a time through what an in-process
`AsyncLLM` runs for it: the engine's sampling params, vLLM's input processor, its output
processor and the messages to and from the engine core (msgpack), with the engine core's
output made up as the read path returns it (the label ids' logprobs at every canvas
position); then the engine's own `parse_output`. `bench/engine_host.py` times each phase
per read."""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.harness.reads import make_reads
from bench.harness.vllm_model import write_model_dir
from bench.harness.vllm_scheduler import BUDGET, PROMPT, WIDTH, vllm_config
from dgstream.workers.engine.types import Read
from dgstream.workers.engine.vllm.codec import build_sampling_params, parse_output
from dgstream.workers.engine.vllm.settings import VllmSettings

VOCAB = 262_144  # the checkpoint's vocabulary

# Where each phase runs: the front end's process, or the engine core's (its side of the
# messages; its scheduler's work is the scheduler table's).
FRONT = ("params", "inputs", "track", "send", "receive", "outputs", "parse")
CORE = ("core_receive", "core_send")


class FrontEnd:
    """One front end's vLLM objects over a CPU config of the served shape (its model's
    config written into `model_dir`)."""

    def __init__(self, batch: int, model_dir: Path) -> None:
        from vllm.v1.engine import EngineCoreOutputs, EngineCoreRequest
        from vllm.v1.engine.input_processor import InputProcessor
        from vllm.v1.engine.output_processor import OutputProcessor
        from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

        model = write_model_dir(model_dir, VOCAB)
        self.settings = VllmSettings(model=str(model), skip_tokenizer_init=True)
        config = vllm_config(model, budget=BUDGET, seqs=batch)
        self.inputs = InputProcessor(config)
        # As AsyncLLM builds it without a tokenizer (skip_tokenizer_init) or stats.
        self.outputs = OutputProcessor(None, log_stats=False)
        self.encoder = MsgpackEncoder()
        self.request_decoder = MsgpackDecoder(EngineCoreRequest)
        self.output_decoder = MsgpackDecoder(EngineCoreOutputs)

    def serve(self, tag: str, reads: list[Read]) -> tuple[dict[str, float], list[Any]]:
        """One batch through every phase: ({phase: seconds}, the reads' results)."""
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
        from vllm.v1.engine.output_processor import RequestOutputCollector
        from vllm.v1.outputs import LogprobsLists

        t: dict[str, float] = {}
        clock = time.perf_counter
        t0 = clock()
        params = [build_sampling_params(read, self.settings) for read in reads]
        t1 = clock()
        requests = []
        for i, (read, p) in enumerate(zip(reads, params, strict=True)):
            prompt: Any = {"type": "token", "prompt_token_ids": list(read.prompt_ids)}
            req = self.inputs.process_inputs(f"{tag}-{i}", prompt, p, ("generate",))
            self.inputs.assign_request_id(req)
            requests.append(req)
        t2 = clock()
        queues = []
        for req in requests:
            queue = RequestOutputCollector(RequestOutputKind.FINAL_ONLY, req.request_id)
            self.outputs.add_request(req, None, queue=queue)
            queues.append(queue)
        t3 = clock()
        frames = [self.encoder.encode(req) for req in requests]
        t4 = clock()
        for f in frames:
            self.request_decoder.decode(f)
        t5 = clock()
        # The engine core's outputs as the read path returns them: the canvas, and at
        # each position the sampled id's logprob then the label ids'.
        outs = []
        for read, req in zip(reads, requests, strict=True):
            labels = sorted({x for s in read.slots for x in s.label_ids})
            ids = np.tile(np.array([7, *labels], dtype=np.int32), (WIDTH, 1))
            logprobs = np.log(np.full(ids.shape, 1 / (len(labels) + 1), dtype=np.float32))
            outs.append(
                EngineCoreOutput(
                    request_id=req.request_id,
                    new_token_ids=[7] * WIDTH,
                    new_logprobs=LogprobsLists(ids, logprobs, np.zeros(WIDTH, dtype=np.int32)),
                    finish_reason=FinishReason.LENGTH,
                )
            )
        t6 = clock()
        message = self.encoder.encode(EngineCoreOutputs(outputs=outs))
        t7 = clock()
        got = self.output_decoder.decode(message)
        t8 = clock()
        self.outputs.process_outputs(got.outputs)
        t9 = clock()
        results = [
            parse_output(read, q.get_nowait()) for read, q in zip(reads, queues, strict=True)
        ]
        t10 = clock()
        t.update(
            params=t1 - t0,
            inputs=t2 - t1,
            track=t3 - t2,
            send=t4 - t3,
            core_receive=t5 - t4,
            core_send=t7 - t6,
            receive=t8 - t7,
            outputs=t9 - t8,
            parse=t10 - t9,
        )
        return t, results


def frontend_cost(batch: int, kind: str, rounds: int, warm: int = 2) -> dict[str, float]:
    """µs per read in each phase (medians over `rounds` batches after `warm`), with
    `front` and `core` their sums: batches of `batch` reads of the card runs' shape
    (`kind` "shared": one prompt and question set, "unique": each its own prompt)."""
    rng = random.Random(0)
    runs: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="dgfront-") as model_dir:
        fe = FrontEnd(batch, Path(model_dir))
        for r in range(warm + rounds):
            # "shared": the whole prompt is the shared prefix, one prompt for every read.
            shared = PROMPT if kind == "shared" else 0
            reads = make_reads(batch, PROMPT, WIDTH, shared, VOCAB, rng)
            t, results = fe.serve(str(r), reads)
            if len(results) != batch:
                raise RuntimeError(f"{len(results)} of {batch} reads came back")
            if r >= warm:
                runs.append({k: v / batch * 1e6 for k, v in t.items()})
    got = {k: statistics.median(run[k] for run in runs) for k in (*FRONT, *CORE)}
    got["front"] = statistics.median(sum(run[k] for k in FRONT) for run in runs)
    got["core"] = statistics.median(sum(run[k] for k in CORE) for run in runs)
    return got


__all__ = ["CORE", "FRONT", "FrontEnd", "frontend_cost"]
