"""The NVFP4 quantizer (its command: `python -m bench.quantize_nvfp4`).

Quantize the committed demo model to NVFP4 in the production checkpoint's format.

The production checkpoint, `RedHatAI/diffusiongemma-26B-A4B-it-NVFP4`, is compressed-tensors
`nvfp4-pack-quantized` (llm-compressor output; the quantization_config vLLM expects is in
docs/model.md, "The NVFP4 demo checkpoint"). This script writes the committed demo model
(`workers/engine/weights/demo/`, fp16) the same way into `workers/engine/weights/demo-nvfp4/`,
so that vLLM's NVFP4 loader and kernels can be run on a model with real weights.

What it writes, and why:
- Quantized: every `nn.Linear` of transformers' `DiffusionGemmaForBlockDiffusion` that the
  scheme's target ("Linear") matches and the ignore list does not, matched with
  compressed-tensors' own matcher (`compressed_tensors.utils.is_match`), plus each expert's
  gate, up and down projections. transformers keeps the experts as two 3-D tensors
  (`experts.gate_up_proj` [E, 2I, H], gate rows first; `experts.down_proj` [E, H, I]), which
  no Linear target matches; vLLM 0.33 loads per-expert names
  (`RoutedExperts.build_expert_params_mapping`: `experts.{e}.{gate,up,down}_proj.*`), so
  each expert is written as three Linears, as a quantized MoE checkpoint carries them.
- Each quantized Linear holds `weight_packed` (uint8 [out, in/2], two E2M1 codes a byte, low
  nibble first), `weight_scale` (float8_e4m3fn [out, in/16], one per group of 16 inputs) and
  `weight_global_scale` (float32 [1]), made by compressed-tensors' `NVFP4PackedCompressor`
  from scales computed by its own `generate_gparam` and `calculate_qparams` (round to
  nearest, no calibration data: weight-only, `input_activations` null, like llm-compressor's
  NVFP4A16 preset with its memoryless min-max observer).
- Global scales (448 x 6 / amax) are shared by the shards vLLM fuses into one layer: q/k/v,
  gate/up, and each expert's gate/up (vLLM's `packed_modules_mapping` for DiffusionGemma).
  vLLM keeps one global scale per fused layer: the linear scheme takes the largest
  (`CompressedTensorsW4A4Fp4.process_weights_after_loading`, which warns), the MoE method
  the gate's (`CompressedTensorsW4A4Nvfp4MoEMethod`), so unequal shard scales would scale
  a shard's weights wrongly. The shared one comes from the shards' joint amax, the value
  llm-compressor's fused-layer update also gives (the smallest of the shards' own).
- Kept as in the source (fp16, bit for bit): embeddings, norms, the routers, the vision
  tower and the self-conditioning MLP. The ignore list is the production one
  (`lm_head`, `re:.*router.*`, `re:.*vision.*`) plus `re:.*self_conditioning.*`: vLLM 0.33
  builds DiffusionGemma's self-conditioning MLP from plain `torch.nn.Linear`
  (`DiffusionGemmaSelfConditioning`), which has no quantization method, so a packed weight
  there is refused at load ("There is no module or parameter named ...").
- Sizes: every quantized input width (256, 192, 48) is a multiple of the group size (16).
  vLLM's NVFP4 kernels take the rest by padding: on Hopper, Humming pads N to 256 and K to
  128 (`humming/linear.py`, `humming/moe.py`); Marlin (Ada, Ampere) pads linears to an
  (N % 64, K % 128) or (N % 128, K % 64) tile (`marlin_padded_nk`) and the experts'
  intermediate size 48 to 64 (hidden size 256 is a multiple of 128,
  `prepare_nvfp4_moe_layer_for_marlin`). So no layer is left out for its shape.
- Beside the weights: config.json (the demo's, plus the quantization_config that
  compressed-tensors' `ModelCompressor.update_config` writes), and the demo's
  generation_config.json, tokenizer and chat template, copied byte for byte.

Deterministic: the same source gives the same bytes (round to nearest on the CPU, tensors
in a fixed order; the config records compressed-tensors' version). About 3 s on 2 CPU
cores (20 s with cold file caches, mostly imports); needs torch, safetensors, transformers
and compressed-tensors (vLLM's dependency, 0.17 here): no GPU, no llm-compressor.

The CPU preview (`--compare N`) runs N held-out demo requests through the transformers
engine on the CPU twice: the demo model, and the NVFP4 weights dequantized exactly to fp32
(emulated: not vLLM's kernels), and prints the answers' agreement, the largest probability
gap and each one's ECE. The GPU comparison through vLLM is
tests/workers/engine/test_vllm_nvfp4_gpu.py.

    python -m bench.quantize_nvfp4                  # writes workers/engine/weights/demo-nvfp4
    python -m bench.quantize_nvfp4 --out DIR
    python -m bench.quantize_nvfp4 --compare 300    # CPU preview, about 35 s
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "workers" / "engine" / "weights" / "demo"
TARGET = ROOT / "workers" / "engine" / "weights" / "demo-nvfp4"

WEIGHTS = "model.safetensors"
# Copied byte for byte from the demo: what vLLM and AutoTokenizer read from a model directory.
COPIED = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)

# The production ignore list (docs/model.md) and the self-conditioning MLP (module docstring).
IGNORE = ["lm_head", "re:.*router.*", "re:.*vision.*", "re:.*self_conditioning.*"]
TARGETS = ["Linear"]
GROUP = 16  # NVFP4's group size: one FP8 scale per 16 weights
# Shards vLLM fuses into one layer (DiffusionGemma's `packed_modules_mapping` in vLLM 0.33):
# they share one global scale.
FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}
PACKED = ("weight_packed", "weight_scale", "weight_global_scale")


def scheme() -> Any:
    """The quantization scheme: compressed-tensors' NVFP4A16 preset on Linear targets
    (weights FP4 E2M1, groups of 16 with FP8 E4M3 scales and a float32 global scale,
    symmetric, static; no activation quantization)."""
    from compressed_tensors.quantization import preset_name_to_scheme

    return preset_name_to_scheme("NVFP4A16", TARGETS)


def quantization_config() -> Any:
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus

    return QuantizationConfig(
        config_groups={"group_0": scheme()},
        format="nvfp4-pack-quantized",
        ignore=list(IGNORE),
        quantization_status=QuantizationStatus.COMPRESSED,
    )


def _fused_key(module: str) -> str:
    parent, _, leaf = module.rpartition(".")
    for name, shards in FUSED.items():
        if leaf in shards:
            return f"{parent}.{name}"
    return module


def _role(module: str, linear: Any) -> str:
    from compressed_tensors.utils import is_match

    return "quantize" if is_match(module, linear, TARGETS, IGNORE) else "dense"


def _meta_model(source: Path) -> Any:
    """transformers' model of the source config on the meta device: its module types
    decide what the Linear target matches, with no weights allocated."""
    import torch
    from transformers import AutoConfig, DiffusionGemmaForBlockDiffusion

    config = AutoConfig.from_pretrained(str(source))
    with torch.device("meta"):
        return DiffusionGemmaForBlockDiffusion(config)


def linear_weights(source: Path) -> Iterator[tuple[str, Any, str]]:
    """(module name, 2-D weight, "quantize" or "dense") for every Linear of the source
    checkpoint, experts split per expert; (tensor name, tensor, "other") for the rest."""
    import torch
    from safetensors import safe_open

    meta = _meta_model(source)
    with safe_open(str(source / WEIGHTS), "pt") as f:
        for name in sorted(f.keys()):
            tensor = f.get_tensor(name)
            if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
                experts = name.rpartition(".")[0]
                for e in range(tensor.shape[0]):
                    w = tensor[e]
                    if name.endswith("gate_up_proj"):
                        gate, up = w.chunk(2, dim=0)  # gate rows first, as transformers reads
                        parts = {"gate_proj": gate, "up_proj": up}
                    else:
                        parts = {"down_proj": w}
                    for leaf, part in parts.items():
                        module = f"{experts}.{e}.{leaf}"
                        with torch.device("meta"):
                            probe = torch.nn.Linear(part.shape[1], part.shape[0], bias=False)
                        yield module, part.contiguous(), _role(module, probe)
                continue
            module = name.removesuffix(".weight")
            if name.endswith(".weight") and tensor.ndim == 2:
                try:
                    sub = meta.get_submodule(module)
                except AttributeError:
                    sub = None
                if isinstance(sub, torch.nn.Linear):
                    yield module, tensor, _role(module, sub)
                    continue
            yield name, tensor, "other"


def _group_range(w: Any) -> tuple[Any, Any]:
    groups = w.reshape(w.shape[0], w.shape[1] // GROUP, GROUP)
    return groups.amin(dim=-1), groups.amax(dim=-1)


def quantize_tensors(source: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The NVFP4 state dict of `source` (tensor name -> tensor) and a summary."""
    import torch
    from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    sch = scheme()
    args = sch.weights
    items = list(linear_weights(source))
    # Joint range of each fused set (q/k/v, gate/up): one global scale for its shards.
    ranges: dict[str, tuple[Any, Any]] = {}
    for module, w, role in items:
        if role == "quantize":
            lo, hi = w.float().min(), w.float().max()
            key = _fused_key(module)
            if key in ranges:
                lo, hi = torch.minimum(lo, ranges[key][0]), torch.maximum(hi, ranges[key][1])
            ranges[key] = (lo, hi)
    out: dict[str, Any] = {}
    summary: dict[str, Any] = {"quantized": [], "dense": []}
    for module, w, role in items:
        if role == "other":
            out[module] = w
            continue
        if role == "dense":
            out[f"{module}.weight"] = w
            summary["dense"].append(module)
            continue
        if w.shape[1] % GROUP:
            raise ValueError(f"{module}: input width {w.shape[1]} is not a multiple of {GROUP}")
        w = w.float()
        global_scale = generate_gparam(*ranges[_fused_key(module)])
        lo, hi = _group_range(w)
        scale, _ = calculate_qparams(lo, hi, args, global_scale=global_scale)
        packed = NVFP4PackedCompressor.compress(
            {"weight": w, "weight_scale": scale, "weight_global_scale": global_scale}, sch
        )
        for key in PACKED:
            out[f"{module}.{key}"] = packed[key].contiguous()
        summary["quantized"].append(module)
    return out, summary


def quantize(source: Path = SOURCE, out: Path = TARGET) -> dict[str, Any]:
    """Write the NVFP4 checkpoint of `source` into `out` (created or replaced file by
    file); returns a summary (Linears quantized and kept dense, bytes)."""
    from compressed_tensors.compressors import ModelCompressor
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    tensors, summary = quantize_tensors(source)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})
    (out / WEIGHTS).chmod(0o644)  # safetensors writes 0600; the package ships it readable
    shutil.copyfile(source / "config.json", out / "config.json")
    ModelCompressor(quantization_config=quantization_config()).update_config(str(out))
    for name in COPIED:
        shutil.copyfile(source / name, out / name)
    summary["bytes"] = (out / WEIGHTS).stat().st_size
    summary["source_bytes"] = (source / WEIGHTS).stat().st_size
    summary["seconds"] = time.perf_counter() - t0
    return summary


# --------------------------------------------------------------------------- reading back


def dequantize_weight(packed: Any, scale: Any, global_scale: Any) -> Any:
    """One Linear's NVFP4 tensors back to float32 weights, exactly (compressed-tensors'
    unpacking and dequantization in float32: FP4 value x FP8 scale / global scale)."""
    import torch
    from compressed_tensors.compressors.nvfp4 import unpack_fp4_from_uint8
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    rows, half = packed.shape
    values = unpack_fp4_from_uint8(packed, rows, half * 2, dtype=torch.float32)
    return dequantize(
        x_q=values,
        scale=scale.to(torch.float32),
        global_scale=global_scale.to(torch.float32),
        dtype=torch.float32,
    )


def dequantized_state_dict(directory: Path) -> dict[str, Any]:
    """The NVFP4 checkpoint in `directory` as a plain state dict in the demo's layout
    (fused 3-D experts), quantized weights in float32, the others as stored."""
    import torch
    from safetensors import safe_open

    with safe_open(str(directory / WEIGHTS), "pt") as f:
        names = f.keys()  # safe_open is not iterable
        raw = {name: f.get_tensor(name) for name in names}
    out: dict[str, Any] = {}
    experts: dict[str, dict[int, dict[str, Any]]] = {}
    for name in sorted(raw):
        if name.endswith(".weight_packed"):
            module = name.removesuffix(".weight_packed")
            w = dequantize_weight(
                raw[name], raw[f"{module}.weight_scale"], raw[f"{module}.weight_global_scale"]
            )
            match = re.fullmatch(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)", module)
            if match:
                experts.setdefault(match[1], {}).setdefault(int(match[2]), {})[match[3]] = w
            else:
                out[f"{module}.weight"] = w
        elif not name.endswith((".weight_scale", ".weight_global_scale")):
            out[name] = raw[name]
    for prefix, by_expert in experts.items():
        order = sorted(by_expert)
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([by_expert[e]["gate_proj"], by_expert[e]["up_proj"]]) for e in order]
        )
        out[f"{prefix}.down_proj"] = torch.stack([by_expert[e]["down_proj"] for e in order])
    return out


def write_dequantized(directory: Path, out: Path) -> Path:
    """A plain (unquantized, float32) checkpoint of the NVFP4 model in `directory`, which
    `TransformersEngine.from_pretrained` loads as it loads the demo. transformers cannot
    load the NVFP4 directory itself: its compressed-tensors loader quantizes Linears, and
    DiffusionGemma's experts are 3-D parameters, not Linears, so the per-expert tensors
    would find no home."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        k: v.to(torch.float32).contiguous() for k, v in dequantized_state_dict(directory).items()
    }
    save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config.pop("quantization_config", None)
    config["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for name in COPIED:
        shutil.copyfile(directory / name, out / name)
    return out


# --------------------------------------------------------------------------- comparison

# The bars NVFP4 answers meet against the unquantized demo model's on the held-out requests,
# on the CPU (tests/workers/engine/test_nvfp4_checkpoint.py) and through vLLM on a GPU
# (test_vllm_nvfp4_gpu.py). Measured on the CPU (fp32, exact: the figures repeat) at 300
# requests: 1 answer of 824 differs, largest probability gap 0.095, ECE 0.0056 against the
# demo's 0.0072; at 2,000 (`--compare 2000`): 7 of 5,412 differ, largest gap 0.255, 99th
# percentile 0.054, ECE 0.0043 against 0.0031. The largest gap is one near-tie question
# and grows with the count, so the 99th percentile and the agreement carry the weight.
# What the bars catch: weights read wrong, e.g. the nibbles of each byte swapped (300
# requests: agreement 0.42, ECE 0.29). What they do not: a whole tensor's scale off by a
# factor (the k_proj global scales x1.5 changed no figure; every global scale halved moved
# the largest gap to 0.156, the same answers): Gemma's norms undo it, so the checkpoint
# tests check the scales themselves. vLLM's bf16 kernels add their own rounding on both
# sides (the bf16 demo's probabilities were within 0.024 of fp32's: test_vllm_gpu.py),
# hence the room above the CPU figures.
MIN_AGREEMENT = 0.99
MAX_GAP = 0.35
MAX_P99_GAP = 0.1
MAX_ECE_RISE = 0.01


def probabilities(answer: Mapping[str, Any]) -> dict[str, float]:
    """A wire answer's distribution over its answers' names."""
    if answer.get("type") == "yes_no":
        p = float(answer["p_yes"])
        return {"yes": p, "no": 1.0 - p}
    return {str(k): float(v) for k, v in answer["probabilities"].items()}


def compare(
    examples: Sequence[Any], reference: Sequence[Any], results: Sequence[Any]
) -> dict[str, Any]:
    """Results against the reference's on the same requests (wire results or models):
    questions, answers that differ, the largest probability gap (and its 99th percentile
    over questions), and each one's accuracy and ECE on the held-out truth
    (`topology.demo_tasks.check`)."""
    from dgstream.topology import demo_tasks

    ref = [demo_tasks.result_dict(r) for r in reference]
    got = [demo_tasks.result_dict(r) for r in results]
    questions = differ = 0
    gaps: list[float] = []  # the largest gap of each question
    for a, b in zip(ref, got, strict=True):
        if a.get("id") != b.get("id"):
            raise ValueError(f"results out of order: {a.get('id')!r} against {b.get('id')!r}")
        for qid, x in a["answers"].items():
            y = b["answers"][qid]
            questions += 1
            differ += demo_tasks.answer_name(x) != demo_tasks.answer_name(y)
            px, py = probabilities(x), probabilities(y)
            if px.keys() != py.keys():
                raise ValueError(f"{a.get('id')}/{qid}: answers over {sorted(px)} and {sorted(py)}")
            gaps.append(max(abs(px[k] - py[k]) for k in px))
    ref_report = demo_tasks.check(demo_tasks.score_results(examples, ref))
    report = demo_tasks.check(demo_tasks.score_results(examples, got))
    return {
        "requests": len(got),
        "questions": questions,
        "answers_differ": differ,
        "agreement": 1.0 - differ / questions if questions else 0.0,
        "max_probability_gap": max(gaps, default=0.0),
        # 99% of the questions' largest gaps are at most this (nearest rank)
        "p99_probability_gap": sorted(gaps)[int(0.99 * (len(gaps) - 1))] if gaps else 0.0,
        "reference": {"accuracy": ref_report.accuracy, "ece": ref_report.ece},
        "quantized": {"accuracy": report.accuracy, "ece": report.ece, "passed": report.passed},
        "counts": report.counts,
    }


def classify_on_cpu(model_dir: Path, requests: Sequence[Any], batch: int = 64) -> list[Any]:
    """The requests through the transformers engine on the CPU (fp32, one read each)."""
    from dgstream.workers.engine.factory import EngineSettings, build_classifier

    classifier = build_classifier(
        EngineSettings(model=str(model_dir), device="cpu", reuse_prefix=False)
    )

    async def run() -> list[Any]:
        out: list[Any] = []
        for i in range(0, len(requests), batch):
            out.extend(await classifier.classify(requests[i : i + batch]))
        return out

    return asyncio.run(run())


def cpu_preview(directory: Path = TARGET, count: int = 300, split: int = 0) -> dict[str, Any]:
    """`count` held-out requests: the demo model against the NVFP4 weights dequantized to
    fp32, both through the transformers engine on the CPU (emulated NVFP4)."""
    from dgstream.topology import demo_tasks

    examples = demo_tasks.held_out_examples(split, count)
    requests = [demo_tasks.validate(ex.request) for ex in examples]
    t0 = time.perf_counter()
    reference = classify_on_cpu(SOURCE, requests)
    with tempfile.TemporaryDirectory(prefix="dgstream-nvfp4-") as tmp:
        results = classify_on_cpu(write_dequantized(directory, Path(tmp)), requests)
    return {**compare(examples, reference, results), "seconds": time.perf_counter() - t0}
