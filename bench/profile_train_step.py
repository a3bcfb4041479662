"""Where a demo-model training step spends its time on the GPU (a diagnostic for
bench/train_demo_model.py): step time with the experts loop (eager, fp32 master weights
under bf16 autocast) against grouped_mm on bf16 weights, and the top ops by CUDA time."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import train_demo_model as T
from dgstream.workers.engine.models import SPECS, tiny_config
from dgstream.workers.engine.tokenizer import save_pretrained_tokenizer


def main() -> None:
    from transformers import DiffusionGemmaForBlockDiffusion

    tok = Path("/tmp/prof-tok")
    tok.mkdir(exist_ok=True)
    save_pretrained_tokenizer(tok)
    T._init_worker(str(tok), 64)
    batch = T.make_group(T.GroupJob(0, 0, 256, 1))[0]
    t = T.to_tensors(batch, "cuda")
    print({k: tuple(v.shape) for k, v in t.items()}, flush=True)

    def run(model: torch.nn.Module, autocast: bool, steps: int = 10) -> float:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for i in range(steps + 3):
            if i == 3:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                logits = T.forward_slots(model, t)
            loss = torch.nn.functional.cross_entropy(logits.float(), t["targets"])
            opt.zero_grad()
            loss.backward()
            opt.step()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / steps

    cfg = tiny_config(SPECS["demo"])
    m = DiffusionGemmaForBlockDiffusion(cfg).cuda()
    m.set_experts_implementation("eager")
    print(f"eager experts, fp32 + autocast: {run(m, True) * 1e3:.1f} ms/step", flush=True)
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]
    ) as prof:
        run(m, True, steps=2)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18), flush=True)
    for impl in ("grouped_mm", "batched_mm"):
        try:
            mb = DiffusionGemmaForBlockDiffusion(cfg).cuda().to(torch.bfloat16)
            mb.set_experts_implementation(impl)
            print(f"{impl}, bf16 weights: {run(mb, False) * 1e3:.1f} ms/step", flush=True)
        except Exception as exc:
            print(f"{impl}: {type(exc).__name__}: {exc}", flush=True)
    m.config._attn_implementation = "eager"
    for sub in m.modules():
        if hasattr(sub, "config") and hasattr(sub.config, "_attn_implementation"):
            sub.config._attn_implementation = "eager"
    print(f"eager experts + eager attention: {run(m, True) * 1e3:.1f} ms/step", flush=True)


if __name__ == "__main__":
    main()
