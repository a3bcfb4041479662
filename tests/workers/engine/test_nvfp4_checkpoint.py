"""The NVFP4 demo checkpoint (`workers/engine/weights/demo-nvfp4/`, made by
`bench/quantize_nvfp4.py`) has the production checkpoint's format, and its weights are the
demo model's within the FP4 grid's error.

Unit tests read the committed files: the quantization_config (the production one, which
compressed-tensors and vLLM's own config parser read as NVFP4 weight-only), every quantized
Linear's packed weight and scales (names, shapes, dtypes, shared global scales, the scales'
values), the dense tensors (the demo's, bit for bit), the weights decoded from the format's
definition, and the script making the same bytes again. The model test runs held-out demo
requests through the transformers engine on the CPU with the NVFP4 weights dequantized to
fp32 (emulated NVFP4, not vLLM's kernels) against the demo model.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import pytest

from bench.harness import nvfp4 as q
from dgstream.workers.engine.models import TRAINED_DIRS

DEMO = TRAINED_DIRS["demo"]
NVFP4 = DEMO.parent / "demo-nvfp4"
FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
}

# The production checkpoint's quantization_config as vLLM expects it (docs/model.md, "The
# NVFP4 demo checkpoint"), with the ignore list this checkpoint adds to (its last entry:
# vLLM 0.33 builds the self-conditioning MLP from plain torch Linears, bench/quantize_nvfp4.py).
PRODUCTION_IGNORE = ["lm_head", "re:.*router.*", "re:.*vision.*"]
IGNORE = [*PRODUCTION_IGNORE, "re:.*self_conditioning.*"]
WEIGHTS = {
    "num_bits": 4,
    "type": "float",
    "strategy": "tensor_group",
    "group_size": 16,
    "symmetric": True,
    "dynamic": False,
}

# The Linears NVFP4 covers, in the demo checkpoint's names: attention and MLP projections of
# every layer (transformers' experts are 3-D tensors, split per expert below).
QUANTIZED = re.compile(r"model\.decoder\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.\w+_proj)")
EXPERTS = re.compile(r"(model\.decoder\.layers\.\d+\.experts)\.(gate_up_proj|down_proj)")
# E2M1: a nibble's low 3 bits index these magnitudes, bit 3 is the sign (the format's
# definition; compressed-tensors' FLOAT_TO_E2M1 and vLLM's kE2M1ToFloat hold the same).
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_MAX, FP8_MAX = 6.0, 448.0


def _tensors(directory: Path) -> dict[str, Any]:
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        names = f.keys()  # safe_open is not iterable
        return {name: f.get_tensor(name) for name in names}


@pytest.fixture(scope="module")
def demo() -> dict[str, Any]:
    return _tensors(DEMO)


@pytest.fixture(scope="module")
def nvfp4() -> dict[str, Any]:
    return _tensors(NVFP4)


@pytest.fixture(scope="module")
def dense_weights(demo: dict[str, Any]) -> dict[str, Any]:
    """Every Linear NVFP4 covers -> its demo weight (float32), experts split per expert
    (gate rows first in transformers' gate_up_proj)."""
    out: dict[str, Any] = {}
    for name, t in demo.items():
        m = EXPERTS.fullmatch(name)
        if m:
            for e in range(t.shape[0]):
                w = t[e].float()
                if m[2] == "gate_up_proj":
                    gate, up = w.chunk(2)
                    out[f"{m[1]}.{e}.gate_proj"], out[f"{m[1]}.{e}.up_proj"] = gate, up
                else:
                    out[f"{m[1]}.{e}.down_proj"] = w
        elif name.endswith(".weight") and QUANTIZED.fullmatch(name.removesuffix(".weight")):
            out[name.removesuffix(".weight")] = t.float()
    return out


def decode(packed: Any, scale: Any, global_scale: Any) -> tuple[Any, Any]:
    """The FP4 values and each weight's effective scale (FP8 scale / global scale) of one
    Linear, from the format's definition alone."""
    import torch

    lut = torch.tensor(E2M1)
    low, high = packed & 0x0F, packed >> 4
    codes = torch.stack([low, high], dim=-1).reshape(packed.shape[0], -1).long()
    values = lut[codes & 0x7] * torch.where(codes & 0x8 > 0, -1.0, 1.0)
    effective = scale.float() / global_scale.float()
    return values, effective.repeat_interleave(16, dim=1)


# --------------------------------------------------------------------------- the files


@pytest.mark.unit
def test_the_directory_holds_a_loadable_small_checkpoint() -> None:
    assert {p.name for p in NVFP4.iterdir()} == FILES
    # The fp16 demo is 7.25 MB; NVFP4 leaves embeddings, norms and the dense Linears.
    assert (NVFP4 / "model.safetensors").stat().st_size < 3_500_000
    # Tokenizer, chat template and generation config are the demo's, byte for byte (vLLM
    # reads the generation config raw and needs its real values: models.py).
    for name in FILES - {"config.json", "model.safetensors"}:
        assert (NVFP4 / name).read_bytes() == (DEMO / name).read_bytes(), name


@pytest.mark.unit
def test_the_quantization_config_is_the_production_format() -> None:
    config = json.loads((NVFP4 / "config.json").read_text())
    qc = config.pop("quantization_config")
    # Everything else is the demo's config.
    assert config == json.loads((DEMO / "config.json").read_text())
    assert qc["quant_method"] == "compressed-tensors"
    assert qc["format"] == "nvfp4-pack-quantized"
    assert qc["quantization_status"] == "compressed"
    assert qc["kv_cache_scheme"] is None
    assert qc["ignore"] == IGNORE
    assert list(qc["config_groups"]) == ["group_0"]
    group = qc["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"]
    assert group["input_activations"] is None
    assert group["output_activations"] is None
    assert {k: group["weights"][k] for k in WEIGHTS} == WEIGHTS
    assert group["weights"]["scale_dtype"] == "torch.float8_e4m3fn"


@pytest.mark.unit
def test_compressed_tensors_reads_it_as_its_nvfp4a16_preset() -> None:
    """What llm-compressor's NVFP4A16 scheme would write, read by compressed-tensors itself."""
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    qc = json.loads((NVFP4 / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(qc)
    assert parsed.format == "nvfp4-pack-quantized"
    assert parsed.config_groups["group_0"] == preset_name_to_scheme("NVFP4A16", ["Linear"])


class _Module:
    """A stand-in that carries a vLLM layer class's name: vLLM's target matcher reads only
    the class name of the module (`find_matched_target`)."""

    def __init__(self, cls: str) -> None:
        self.__class__ = type(cls, (_Module,), {})


@pytest.mark.vllm
def test_vllm_reads_every_quantized_layer_as_nvfp4_weight_only() -> None:
    """vLLM 0.33's own config parser and matcher, with DiffusionGemma's name mapping: the
    fused attention and MLP layers and the experts get NVFP4 weights with no activation
    quantization (its W4A16 path: `CompressedTensorsW4A4Fp4(use_a16=True)` and the NVFP4
    MoE method); the router, the LM head and the vision tower are left dense."""
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )
    from vllm.model_executor.models.diffusion_gemma import (
        DiffusionGemmaForConditionalGeneration as Model,
    )

    qc = json.loads((NVFP4 / "config.json").read_text())["quantization_config"]
    config = CompressedTensorsConfig.from_config(qc)
    config.packed_modules_mapping = dict(Model.packed_modules_mapping)
    config.apply_vllm_mapper(Model.hf_to_vllm_mapper)
    config._add_fused_moe_to_target_scheme_map()  # as `get_moe_method` does first
    layers = 6
    quantized = [
        ("self_attn.qkv_proj", "QKVParallelLinear"),
        ("self_attn.o_proj", "RowParallelLinear"),
        ("mlp.gate_up_proj", "MergedColumnParallelLinear"),
        ("mlp.down_proj", "RowParallelLinear"),
        # RoutedExperts asks for its first expert's projections (`get_moe_method`).
        ("experts.0.gate_proj", "RoutedExperts"),
        ("experts.0.up_proj", "RoutedExperts"),
        ("experts.0.down_proj", "RoutedExperts"),
    ]
    for i in range(layers):
        for leaf, cls in quantized:
            scheme = config.get_scheme_dict(_Module(cls), f"model.layers.{i}.{leaf}")
            assert scheme is not None, leaf
            assert config._is_nvfp4_format(scheme["weights"]), (leaf, scheme)
            assert scheme["input_activations"] is None, leaf
            assert scheme["format"] == "nvfp4-pack-quantized"
        assert (
            config.get_scheme_dict(_Module("GateLinear"), f"model.layers.{i}.router.proj") is None
        )
    assert config.get_scheme_dict(_Module("ParallelLMHead"), "lm_head") is None
    vision = "vision_tower.encoder.layers.0.mlp.up_proj.linear"
    assert config.get_scheme_dict(_Module("Linear"), vision) is None


# --------------------------------------------------------------------------- the tensors


@pytest.mark.unit
def test_every_quantized_linear_is_packed_with_the_right_shapes_and_dtypes(
    nvfp4: dict[str, Any], dense_weights: dict[str, Any]
) -> None:
    import torch

    # 6 layers x (q, k, v, o; no v in the full-attention layer) + 6 x 3 MLP + 6 x 4 x 3 experts
    assert len(dense_weights) == 6 * 4 - 1 + 6 * 3 + 6 * 4 * 3 == 113
    packed = {name.rpartition(".")[0] for name in nvfp4 if name.endswith(".weight_packed")}
    assert packed == set(dense_weights)
    for module, w in dense_weights.items():
        rows, cols = w.shape
        assert cols % 16 == 0, module
        got = {
            k.removeprefix(module + "."): v for k, v in nvfp4.items() if k.startswith(module + ".")
        }
        assert set(got) == {"weight_packed", "weight_scale", "weight_global_scale"}, module
        assert got["weight_packed"].dtype == torch.uint8
        assert tuple(got["weight_packed"].shape) == (rows, cols // 2)
        assert got["weight_scale"].dtype == torch.float8_e4m3fn
        assert tuple(got["weight_scale"].shape) == (rows, cols // 16)
        assert got["weight_global_scale"].dtype == torch.float32
        assert tuple(got["weight_global_scale"].shape) == (1,)
        scale = got["weight_scale"].float()
        assert bool((scale >= 0).all()) and bool(torch.isfinite(scale).all()), module
        assert float(got["weight_global_scale"]) > 0, module


@pytest.mark.unit
def test_the_dense_tensors_are_the_demos_bit_for_bit(
    demo: dict[str, Any], nvfp4: dict[str, Any]
) -> None:
    """Embeddings, norms, router, vision tower and self-conditioning: as the demo stores
    them (fp16), and nothing else beside the packed Linears."""
    dense = {
        k: v
        for k, v in demo.items()
        if not EXPERTS.fullmatch(k) and not QUANTIZED.fullmatch(k.removesuffix(".weight"))
    }
    assert any(".router.proj." in k for k in dense)
    assert any("self_conditioning.gate_proj" in k for k in dense)
    assert any("vision_tower" in k for k in dense)
    rest = {k: v for k, v in nvfp4.items() if not k.endswith(q.PACKED)}
    assert set(rest) == set(dense)
    for name, t in dense.items():
        assert rest[name].dtype == t.dtype, name
        assert rest[name].shape == t.shape and bool((rest[name] == t).all()), name


@pytest.mark.unit
def test_fused_shards_share_one_global_scale_from_their_joint_range(
    nvfp4: dict[str, Any], dense_weights: dict[str, Any]
) -> None:
    """vLLM keeps one global scale per fused layer (q/k/v, gate/up, an expert's gate/up):
    the shards share it, 448 x 6 over their joint absolute maximum."""
    import torch

    groups: dict[str, list[str]] = {}
    for module in dense_weights:
        parent, _, leaf = module.rpartition(".")
        key = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv"}.get(leaf, leaf)
        key = {"gate_proj": "gate_up", "up_proj": "gate_up"}.get(key, key)
        groups.setdefault(f"{parent}.{key}", []).append(module)
    shared = [g for g in groups.values() if len(g) > 1]
    assert len(shared) == 6 + 6 + 6 * 4  # qkv, MLP gate/up, each expert's gate/up
    for members in groups.values():
        amax = max(float(dense_weights[m].abs().max()) for m in members)
        want = torch.tensor(FP8_MAX * FP4_MAX / amax, dtype=torch.float32)
        for m in members:
            got = nvfp4[f"{m}.weight_global_scale"]
            assert torch.allclose(got, want.reshape(1), rtol=1e-6), (m, got, want)
        assert len({float(nvfp4[f"{m}.weight_global_scale"]) for m in members}) == 1


@pytest.mark.unit
def test_group_scales_are_fp8_round_to_nearest_of_the_group_range(
    nvfp4: dict[str, Any], dense_weights: dict[str, Any]
) -> None:
    """Each group of 16 weights: its FP8 scale is the global scale x amax / 6 rounded to
    the nearest E4M3 value (the group's largest weight lands on FP4's largest value)."""
    import torch

    for module, w in dense_weights.items():
        gs = nvfp4[f"{module}.weight_global_scale"].float()
        amax = w.reshape(w.shape[0], -1, 16).abs().amax(-1)
        # amax / 6 first, then x global scale: compressed-tensors' order
        # (`calculate_qparams`); the other order rounds a few exact ties the other way.
        want = (gs * (amax / FP4_MAX)).to(torch.float8_e4m3fn).float()
        got = nvfp4[f"{module}.weight_scale"].float()
        zero = amax == 0
        assert torch.equal(got[~zero], want[~zero]), module
        assert bool((got[zero] > 0).all()), module  # an all-zero group keeps a usable scale


@pytest.mark.unit
def test_dequantized_weights_are_within_the_fp4_grids_error(
    nvfp4: dict[str, Any], dense_weights: dict[str, Any]
) -> None:
    """Decoded from the format's definition, every weight is its demo value rounded to the
    nearest point of the FP4 grid at its group's scale (clamped at +-6 scales); the
    script's reader and compressed-tensors' decompressor give the same weights."""
    import torch
    from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor

    scheme = q.scheme()
    worst = 0.0
    for module, w in dense_weights.items():
        tensors = {k: nvfp4[f"{module}.{k}"] for k in q.PACKED}
        values, effective = decode(*(tensors[k] for k in q.PACKED))
        ours = values * effective
        # The script's reader (used by the CPU comparison below) is exact.
        assert torch.equal(q.dequantize_weight(*(tensors[k] for k in q.PACKED)), ours), module
        # compressed-tensors' decompressor returns bf16: the same within bf16's rounding.
        theirs = NVFP4PackedCompressor.decompress(tensors, scheme)["weight"].float()
        assert torch.allclose(theirs, ours, rtol=2**-8, atol=0), module
        # Nearest grid point: a scaled weight below 2 is at most 0.25 from its FP4 value
        # (grid step 0.5), below 4 at most 0.5, below 6 at most 1; above 6 it is clamped,
        # and the FP8 rounding of the scale (at most 1/16 relative) bounds how far above.
        scaled = w / effective
        bound = torch.where(scaled.abs() < 2, 0.25, torch.where(scaled.abs() < 4, 0.5, 1.0))
        inside = scaled.abs() <= FP4_MAX
        err = (scaled - values).abs()
        assert bool((err[inside] <= bound[inside] + 1e-4).all()), module
        assert bool((values[~inside].abs() == FP4_MAX).all()), module
        assert bool((scaled[~inside].abs() <= FP4_MAX * 17 / 16).all()), module
        worst = max(worst, float((ours - w).norm() / w.norm()))
    # Round to nearest on E2M1 with per-16 absmax scales: 9.5-9.7% relative RMS error per
    # tensor on these weights (measured); a wrong scale or a shuffled nibble is far above.
    assert worst < 0.11, worst


@pytest.mark.unit
def test_the_script_makes_the_committed_bytes(tmp_path: Path) -> None:
    q.quantize(DEMO, tmp_path)
    for name in FILES:
        made = hashlib.sha256((tmp_path / name).read_bytes()).hexdigest()
        committed = hashlib.sha256((NVFP4 / name).read_bytes()).hexdigest()
        assert made == committed, f"{name}: run `python -m bench.quantize_nvfp4` and commit"
    assert {p.name for p in tmp_path.iterdir()} == FILES


@pytest.mark.unit
def test_the_package_ships_the_checkpoint() -> None:
    import tomllib

    root = Path(__file__).resolve().parents[3]
    data = tomllib.loads((root / "pyproject.toml").read_text())
    globs = data["tool"]["setuptools"]["package-data"]["dgstream.workers"]
    package = root / "workers"
    shipped = {p.relative_to(package) for g in globs for p in package.glob(g)}
    assert {Path("engine/weights/demo-nvfp4") / name for name in FILES} <= shipped


# --------------------------------------------------------------------------- the model

# Held-out requests for the CPU preview: 300 (824 questions) run in about 35 s on 2 cores,
# both models (the demo model's own held-out test uses the same count).
PREVIEW_REQUESTS = 300


@pytest.mark.model
def test_emulated_nvfp4_answers_as_the_demo_model() -> None:
    """The held-out requests through the transformers engine on the CPU: the demo model
    against the NVFP4 weights dequantized exactly to fp32 (emulated NVFP4, not vLLM's
    kernels). The answers agree, the probabilities stay close, and the NVFP4 model passes
    the demo model's own bar (accuracy >= 0.95 per kind, ECE <= 0.05)."""
    from demo_model_bar import MIN_QUESTIONS

    preview = q.cpu_preview(NVFP4, PREVIEW_REQUESTS)
    print(
        f"\nemulated NVFP4 vs demo (CPU, fp32, {preview['requests']} requests, "
        f"{preview['questions']} questions): agreement {preview['agreement']:.4f} "
        f"({preview['answers_differ']} differ), largest probability gap "
        f"{preview['max_probability_gap']:.4f} (p99 {preview['p99_probability_gap']:.4f}), "
        f"ECE {preview['quantized']['ece']:.4f} against {preview['reference']['ece']:.4f}"
    )
    assert preview["questions"] >= 3 * MIN_QUESTIONS
    # The bars and their measured figures: tests/support/nvfp4.py, MIN_AGREEMENT.
    assert preview["agreement"] >= q.MIN_AGREEMENT, preview
    assert preview["max_probability_gap"] <= q.MAX_GAP, preview
    assert preview["p99_probability_gap"] <= q.MAX_P99_GAP, preview
    assert preview["quantized"]["passed"], preview
    assert preview["quantized"]["ece"] <= preview["reference"]["ece"] + q.MAX_ECE_RISE, preview
