"""The training run and its command line (`python -m bench.train_demo_model`)."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.training.check import engine_check, parity_check
from bench.training.data import MIX_FIELDS, Batches, GroupJob, mix_flags
from bench.training.model import (
    capture_pointer,
    forward_slots,
    label_hits,
    lr_at,
    pointer_loss,
    scale_qk_norms,
    to_tensors,
    use_experts,
)
from bench.training.questions import IMAGE_KINDS, KINDS
from dgstream.workers.engine.template import ChatFormat


def train(args: argparse.Namespace) -> dict[str, Any]:
    """One training run: the model, the steps, the saved weights, the checks; returns the
    log it also writes to `<out>/train_log.json`."""
    import torch

    from dgstream.workers.engine.models import SPECS

    t_start = time.perf_counter()
    device, cuda = _device(args)
    spec = SPECS["demo"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    chat, model = _model(args, spec, out, device)
    n_params = sum(p.numel() for p in model.parameters())
    opt = _optimizer(model, args, cuda)
    run = _Run(args, cuda)
    mix = {name: getattr(args, name) for name in MIX_FIELDS}
    batches = Batches(
        out, spec.canvas_length, GroupJob(args.seed, 0, args.batch, args.group, **mix), args.workers
    )
    print(
        f"demo model: {n_params / 1e6:.2f} M parameters on {device}; batch {args.batch} "
        f"requests; steps {args.steps}; workers {args.workers}",
        flush=True,
    )
    pointer: dict[str, Any] | None = None
    if args.point_weight > 0:
        pointer, undo_pointer = capture_pointer(model, args.point_layer)
    run.steps(model, opt, batches, device, pointer)
    batches.close()
    if pointer is not None:
        undo_pointer()
    if cuda:
        torch.cuda.synchronize()
    train_seconds = time.perf_counter() - run.t_train

    log = run.log
    _save(model, out, log, args, spec, device, n_params, run, train_seconds, mix)
    if args.smoke:
        worst = parity_check(model.float(), chat, out)
        log["parity_max_abs_diff"] = worst
        print(f"parity, training forward vs TransformersEngine: max |dp| = {worst:.2e}")
        if args.image_share > 0:
            with_images = parity_check(model.float(), chat, out, images=True)
            log["parity_images_max_abs_diff"] = with_images
            print(f"parity with images: max |dp| = {with_images:.2e}")
            worst = max(worst, with_images)
        if worst > 1e-4:
            raise SystemExit("the training forward does not match the engine")

    (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    if args.eval_count:
        log["held_out"] = _held_out(out, device, args.eval_count)
        if args.image_share > 0:
            log["held_out_images"] = _held_out(out, device, args.eval_count, images=True)
    log["wall_seconds"] = round(time.perf_counter() - t_start, 1)
    (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    print(f"wall {log['wall_seconds']}s", flush=True)
    return log


def _device(args: argparse.Namespace) -> tuple[str, bool]:
    import torch

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = device.startswith("cuda")
    if cuda:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    # Deterministic kernels on the CPU; on CUDA they made the step several times slower
    # (index_add_/scatter in the MoE), and the committed weights are the artifact anyway.
    torch.use_deterministic_algorithms(not cuda or args.deterministic, warn_only=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    return device, cuda


def _model(args: argparse.Namespace, spec: Any, out: Path, device: str) -> tuple[ChatFormat, Any]:
    """The tokenizer (saved next to the weights) and the model, seeded, on `device`."""
    import torch
    from transformers import AutoTokenizer, DiffusionGemmaForBlockDiffusion

    from dgstream.workers.engine.models import tiny_config
    from dgstream.workers.engine.tokenizer import save_pretrained_tokenizer

    # The tokenizer the model is trained with is the one saved next to it (the same path
    # `ensure_tiny_model` uses).
    save_pretrained_tokenizer(out)
    chat = ChatFormat(AutoTokenizer.from_pretrained(str(out)))

    torch.manual_seed(spec.seed)
    model: Any = DiffusionGemmaForBlockDiffusion(tiny_config(spec))
    if args.init:
        # Continue from saved weights (fp16 on disk -> fp32 master weights here).
        init = DiffusionGemmaForBlockDiffusion.from_pretrained(args.init, dtype=torch.float32)
        model.load_state_dict(init.state_dict())
        print(f"continuing from {args.init}", flush=True)
    if args.qk_norm_scale is None:
        # A fresh model gets logits of unit spread (see scale_qk_norms); saved weights
        # already carry their learned scale.
        args.qk_norm_scale = 1.0 if args.init else round(spec.head_dim**-0.25, 4)
    if args.qk_norm_scale != 1.0:
        scale_qk_norms(model, args.qk_norm_scale)
        print(f"q_norm/k_norm weights scaled by {args.qk_norm_scale}", flush=True)
    model = model.to(device)
    # The experts: `grouped_mm` (the default) wants bf16 weights on CUDA, and the master
    # weights here are fp32 under bf16 autocast; `dense` computes the same sum with fewer
    # kernels. The saved config keeps the default.
    use_experts(model, args.experts)
    model.train()
    return chat, model


def _optimizer(model: Any, args: argparse.Namespace, cuda: bool) -> Any:
    import torch

    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay}],
        lr=args.lr,
        betas=(0.9, 0.95),
        weight_decay=0.0,
        fused=cuda,
    )


class _Run:
    """The step loop's state: the schedule, the logging windows, the log."""

    def __init__(self, args: argparse.Namespace, cuda: bool) -> None:
        self.args, self.cuda = args, cuda
        self.auto_steps = args.steps == "auto"
        self.total = args.max_steps if self.auto_steps else int(args.steps)
        self.warmup = args.warmup if self.auto_steps else min(args.warmup, max(1, self.total // 10))
        self.log: dict[str, Any] = {"loss": [], "slot_accuracy": [], "pointer_weight": []}
        self.step = 0
        self.stopped_early = False
        self.data_wait = 0.0
        self.t_train = self.t_calib = time.perf_counter()
        self._reset_windows()

    def _reset_windows(self) -> None:
        self.window_loss: list[Any] = []
        self.window_hits: dict[int, list[Any]] = collections.defaultdict(list)
        self.window_point: list[Any] = []

    def steps(self, model: Any, opt: Any, batches: Batches, device: str, pointer: Any) -> None:
        while self.step < self.total:
            lr = self._one_step(model, opt, batches, device, pointer)
            self._calibrate()
            if self.step % self.args.log_every == 0 or self.step == self.total:
                self._report(lr)
            limit = self.args.time_limit_s
            if limit and time.perf_counter() - self.t_train > limit:
                print(f"time limit {limit}s reached at step {self.step}", flush=True)
                self.stopped_early = True
                break

    def _one_step(self, model: Any, opt: Any, batches: Batches, device: str, pointer: Any) -> float:
        import torch

        args = self.args
        t_wait = time.perf_counter()
        batch = batches.get()
        self.data_wait += time.perf_counter() - t_wait
        t = to_tensors(batch, device)
        lr = lr_at(self.step, self.total, args.lr, self.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.cuda):
            logits = forward_slots(model, t)
        loss = torch.nn.functional.cross_entropy(logits.float(), t["targets"])
        total_loss = loss
        if pointer is not None:
            p_loss, p_weight = pointer_loss(pointer.pop("w"), t)
            total_loss = loss + args.point_weight * p_loss
            self.window_point.append(p_weight.detach())
        opt.zero_grad(set_to_none=True)
        total_loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        self.step += 1
        self.window_loss.append(loss.detach())
        hits = label_hits(logits.detach(), t)
        for k in range(len(KINDS)):
            sel = t["kinds"] == k  # no boolean indexing: it would sync with the GPU
            self.window_hits[k].append(torch.stack([(hits & sel).sum(), sel.sum()]))
        return lr

    def _calibrate(self) -> None:
        """`--steps auto`: time steps 20-70 and fit the run to the budget."""
        import torch

        if not self.auto_steps or self.step not in (20, 70):
            return
        if self.cuda:
            torch.cuda.synchronize()
        if self.step == 20:
            self.t_calib = time.perf_counter()
            return
        args = self.args
        per_step = (time.perf_counter() - self.t_calib) / 50
        left = args.budget_s - (time.perf_counter() - self.t_train)
        total = max(args.warmup + 100, min(args.max_steps, 70 + int(left / per_step)))
        self.total = total // 50 * 50
        print(f"--steps auto: {per_step * 1e3:.1f} ms/step -> {self.total} steps", flush=True)

    def _report(self, lr: float) -> None:
        import torch

        mean_loss = float(torch.stack(self.window_loss).mean())
        acc = {}
        for k, kind in enumerate(KINDS):
            h = torch.stack(self.window_hits[k]).sum(0)
            if kind in IMAGE_KINDS and not self.args.image_share:
                continue  # a text-only run logs what it always did
            acc[kind] = round(float(h[0]) / max(1, float(h[1])), 4)
        elapsed = time.perf_counter() - self.t_train
        self.log["loss"].append([self.step, round(mean_loss, 5)])
        self.log["slot_accuracy"].append([self.step, acc])
        point = ""
        if self.window_point:
            mean_point = round(float(torch.stack(self.window_point).mean()), 4)
            self.log["pointer_weight"].append([self.step, mean_point])
            point = f" pointer {mean_point:.3f}"
        print(
            f"step {self.step:5d}/{self.total} loss {mean_loss:.4f} acc {acc}{point} "
            f"lr {lr:.2e} {elapsed:6.1f}s (waiting for data {self.data_wait:.1f}s)",
            flush=True,
        )
        self._reset_windows()


def _save(
    model: Any,
    out: Path,
    log: dict[str, Any],
    args: argparse.Namespace,
    spec: Any,
    device: str,
    n_params: int,
    run: _Run,
    train_seconds: float,
    mix: dict[str, Any],
) -> None:
    """Save in fp16 (the size budget; 3 more mantissa bits than bf16), with the tokenizer
    already there; bf16 only if a weight left fp16's range. The run's figures go to `log`."""
    import torch

    from dgstream.workers.engine.models import write_generation_config

    model.eval()
    model.to("cpu")
    biggest = max(float(p.detach().abs().max()) for p in model.parameters())
    save_dtype = torch.float16 if biggest < 6e4 else torch.bfloat16
    model.to(save_dtype).save_pretrained(str(out))
    write_generation_config(out, model.config)  # vLLM needs real values, not nulls
    size_mb = (out / "model.safetensors").stat().st_size / 1e6
    step, warmup = run.step, run.warmup
    log.update(
        {
            "spec": dataclasses.asdict(spec),
            "parameters": n_params,
            "device": device,
            "torch": torch.__version__,
            "steps": step,
            "steps_arg": args.steps,
            "stopped_early": run.stopped_early,
            "batch_requests": args.batch,
            "lr": args.lr,
            "warmup": warmup,
            "weight_decay": args.weight_decay,
            "seed": args.seed,
            "train_seconds": round(train_seconds, 1),
            "weights_dtype": str(save_dtype).removeprefix("torch."),
            "largest_weight": round(biggest, 3),
            "safetensors_mb": round(size_mb, 3),
            "experts": args.experts,
            "qk_norm_scale": args.qk_norm_scale,
            "point_layer": args.point_layer,
            "point_weight": args.point_weight,
            **mix,
            "replay": _replay(args, step, warmup, mix),
        }
    )
    print(f"saved {out} ({size_mb:.2f} MB, {step} steps in {train_seconds:.1f}s)", flush=True)


def _replay(args: argparse.Namespace, step: int, warmup: int, mix: dict[str, Any]) -> str:
    """The flags that run this schedule again."""
    flags = (
        f"--steps {step} --batch {args.batch} --group {args.group} "
        f"--lr {args.lr} --warmup {warmup} --seed {args.seed} --experts {args.experts}"
        f" --qk-norm-scale {args.qk_norm_scale} {mix_flags(mix)}"
    )
    if args.point_weight > 0:
        flags += f" --point-layer {args.point_layer} --point-weight {args.point_weight}"
    return flags + (f" --init {args.init}" if args.init else "")


def _held_out(out: Path, device: str, count: int, images: bool = False) -> dict[str, Any]:
    """The engine as it runs on this device (bf16 on CUDA, its default; fp32 on the CPU)
    over `count` held-out requests (`images`: of the image family, its image questions)."""
    try:
        report, extra = engine_check(out, device, count, split=0, images=images)
    except Exception as exc:  # the weights are saved; fall back to the CPU
        print(f"engine check on {device} failed ({exc!r}); retrying on the CPU", flush=True)
        report, extra = engine_check(out, "cpu", count, split=0, images=images)
    family = "image questions, " if images else ""
    print(f"held-out (engine, {family}{count} requests): {report.summary()}")
    print(f"  per task: { {k: round(v, 4) for k, v in report.task_accuracy.items()} }")
    return {
        "split": 0,
        "requests": count,
        "accuracy": report.accuracy,
        "task_accuracy": report.task_accuracy,
        "counts": report.counts,
        "ece": round(report.ece, 5),
        "passed": report.passed,
        **extra,
    }


def main(argv: Sequence[str] | None = None, description: str = "") -> int:
    p = argparse.ArgumentParser(description=description or "Train the demo model.")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda")
    p.add_argument("--steps", default="3000", help='a number, or "auto" (see --budget-s)')
    p.add_argument("--max-steps", type=int, default=20000, help="cap for --steps auto")
    p.add_argument("--budget-s", type=float, default=200.0, help="training time for auto")
    p.add_argument("--time-limit-s", type=float, default=0.0, help="hard stop (0 = none)")
    p.add_argument("--batch", type=int, default=256, help="requests per step")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0, help="training stream")
    p.add_argument("--group", type=int, default=4, help="batches bucketed by prompt length")
    p.add_argument("--workers", type=int, default=-1, help="data processes (-1: cores - 2)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    p.add_argument("--eval-count", type=int, default=2000, help="held-out requests at the end")
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--out", default="build/demo-model")
    p.add_argument("--smoke", action="store_true", help="20 CPU steps, parity + tiny eval")
    p.add_argument("--init", default="", help="continue from a saved model directory")
    p.add_argument(
        "--experts",
        choices=("eager", "dense"),
        default="dense",
        help="MoE implementation while training (the same sums; dense has fewer kernels)",
    )
    p.add_argument(
        "--qk-norm-scale",
        type=float,
        default=None,
        help="multiply the q_norm/k_norm weights after init or --init (default: "
        "head_dim ** -0.25 for a fresh model, 1.0 with --init; see scale_qk_norms)",
    )
    p.add_argument(
        "--keep-other",
        type=float,
        default=1.0,
        help="share of the requests WITHOUT a choice question kept in training (1.0: the "
        "family as it comes; 0.3: about 4 in 5 training requests hold a choice question)",
    )
    p.add_argument(
        "--category-share",
        type=float,
        default=0.0,
        help="share of the training requests (with fewer than 4 questions) that get one more "
        "yes/no question naming a topic or language (see with_category_question)",
    )
    p.add_argument(
        "--name-share",
        type=float,
        default=0.0,
        help="share of the training requests (with fewer than 4 questions) that get one more "
        "question whose answer is the NAME of their topic or language (see with_name_question)",
    )
    p.add_argument(
        "--mention-share",
        type=float,
        default=0.0,
        help="share of the training requests (with fewer than 4 questions) whose state gets a "
        "category name and a choice question asking which (see with_mention_question)",
    )
    p.add_argument(
        "--aux-only",
        action="store_true",
        help="train on the training-only questions alone (a diagnostic: can the model learn "
        "them by themselves?)",
    )
    p.add_argument(
        "--image-share",
        type=float,
        default=0.0,
        help="share of the training requests read as the image family's request of the same "
        "seed (topology/demo_tasks/images.py: a picture and questions about it beside some "
        "of the text questions; 0: the text family alone)",
    )
    p.add_argument(
        "--point-weight",
        type=float,
        default=0.0,
        help="weight of an auxiliary loss that teaches the choice pointer: at each choice "
        "and mention slot, -log of the attention weight that the best head of decoder layer "
        "--point-layer puts on the right option's name (see pointer_loss; 0: off)",
    )
    # 3: the layer whose head already pointed at "english" before the loss existed; from
    # there choice reached 0.95 in 200 steps, from layer 5 in 400 (round 9, docs/benchmarks.md).
    p.add_argument("--point-layer", type=int, default=3, help="decoder layer for --point-weight")
    p.add_argument(
        "--deterministic", action="store_true", help="deterministic kernels on CUDA too (slow)"
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.device, args.steps, args.batch, args.log_every = "cpu", "20", 4, 5
        args.group = 1
        args.eval_count = min(args.eval_count, 16)
        args.warmup = 5
        if args.workers < 0:
            args.workers = 0
    if args.workers < 0:
        args.workers = max(1, min(14, (os.cpu_count() or 4) - 2))
    if args.steps != "auto" and not args.steps.isdigit():
        p.error('--steps takes a number or "auto"')
    train(args)
    return 0
