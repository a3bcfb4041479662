"""Our prompts for a Gemma 4 style checkpoint are vLLM 0.33's own DiffusionGemma reads, token
for token (CPU; vLLM's code, no GPU).

vLLM's `DiffusionGemmaCanvasStrategy` renders the chat with its `ReadPromptRequest` chat
parameters (generation prompt, thinking off) through its `safe_apply_chat_template`, then
`_read_input` appends the empty thought block `<|channel>thought\\n<channel|>` outside the
canvas, and its canvases end with `<turn|>` and the pad token. The real checkpoint's
tokenizer cannot be had here, so the tokenizer is the project's own byte-level BPE with
Gemma 4's turn and channel tokens added and a Gemma 4 style chat template (turns
`<|turn>role ... <turn|>`, a `<|think|>` marker in the system turn unless thinking is
switched off, so a prompt rendered without the switch differs):
what is checked is that our rendering follows vLLM's for any such template, not the real
template's text.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from dgstream.workers.engine.models import DIFFUSION_GENERATION
from dgstream.workers.engine.template import ChatFormat, make_read, resolve_layout

if os.environ.get("DGSTREAM_SKIP_VLLM") == "1":
    pytest.skip("DGSTREAM_SKIP_VLLM=1", allow_module_level=True)

from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.openai.decisions.strategies import (
    DiffusionGemmaCanvasStrategy,
    ReadPromptRequest,
)
from vllm.inputs import tokens_input
from vllm.renderers.hf import safe_apply_chat_template

pytestmark = [pytest.mark.vllm]

GEMMA4_STYLE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "<|turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m['role'] == 'system' and (enable_thinking is not defined or enable_thinking) %}"
    "<|think|>{% endif %}{{ m['content'] }}<turn|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)
GEMMA4_TOKENS = ["<|turn>", "<turn|>", "<|channel>", "<channel|>", "<|think|>"]

CASES = [
    ("Question toxic (yes/no): Is it rude?\n  Labels: yes, no", "you idiot!!!"),
    (
        "Question a (choice): Which?\n  A: sport\n  B: news\n  Labels: A, B",
        "\nstarts with a newline",
    ),
    ("short", "  spaces, then ünïcödé and an emoji \U0001f600"),
    ("Question s (score, 1 = lowest): How bad?\n  1: none\n  2: bad\n  Labels: 1, 2", ""),
]


@pytest.fixture(scope="module")
def gemma4_style(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    from transformers import PreTrainedTokenizerFast

    from dgstream.workers.engine.tokenizer import build_tokenizer

    raw = build_tokenizer()
    raw.add_special_tokens(GEMMA4_TOKENS)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"
    )
    tok.chat_template = GEMMA4_STYLE_TEMPLATE
    model_dir: Path = tmp_path_factory.mktemp("gemma4-style")
    tok.save_pretrained(str(model_dir))
    config = {
        "architectures": ["DiffusionGemmaForBlockDiffusion"],
        "model_type": "diffusion_gemma",
        "canvas_length": 256,
        "torch_dtype": "bfloat16",
        "text_config": {"model_type": "diffusion_gemma_text", "vocab_size": len(tok)},
    }
    (model_dir / "config.json").write_text(json.dumps(config))
    (model_dir / "generation_config.json").write_text(json.dumps(DIFFUSION_GENERATION))
    model_config = AsyncEngineArgs(
        model=str(model_dir), skip_tokenizer_init=True, diffusion_config={"canvas_length": 64}
    ).create_model_config()
    # The strategy's own state that `_read_input` reads, built as its __init__ builds it.
    strategy: Any = object.__new__(DiffusionGemmaCanvasStrategy)
    strategy.thought = tok.encode(DiffusionGemmaCanvasStrategy.THOUGHT, add_special_tokens=False)
    strategy.width = DiffusionGemmaCanvasStrategy.CANVAS_STEP
    strategy.max_model_len = 16_384
    end = tok.encode(DiffusionGemmaCanvasStrategy.END_OF_TURN, add_special_tokens=False)
    return SimpleNamespace(tok=tok, model_config=model_config, strategy=strategy, end=end)


def vllm_prompt(env: SimpleNamespace, system: str, user: str) -> list[int]:
    """What vLLM's DiffusionGemma read sends for these messages (its code, step by step)."""
    params = ReadPromptRequest().build_chat_params(None, "auto")
    ids = safe_apply_chat_template(
        env.model_config,
        env.tok,
        [{"role": "system", "content": system}, {"role": "user", "content": user}],
        chat_template=params.chat_template,
        tokenize=True,
        **params.chat_template_kwargs,
    )
    read_input = env.strategy._read_input(tokens_input(list(ids)), list(ids))
    return list(read_input["prompt_token_ids"])


@pytest.mark.parametrize(("system", "user"), CASES)
def test_prompt_is_vllms_token_for_token(gemma4_style: SimpleNamespace, system: str, user: str):
    chat = ChatFormat(gemma4_style.tok)
    ours, shared = chat.prompt_ids(system, user)
    theirs = vllm_prompt(gemma4_style, system, user)
    assert list(ours) == theirs
    # The thought block closes the prompt, outside the canvas, and thinking is off.
    assert list(ours[-len(chat.thought_ids) :]) == gemma4_style.strategy.thought
    assert gemma4_style.tok.convert_tokens_to_ids("<|think|>") not in ours
    # The shared prefix is the chat up to the user's text, and the same for every user text.
    assert 0 < shared < len(ours)
    assert ours[:shared] == chat.prefix_ids(system)


def test_thinking_on_would_differ(gemma4_style: SimpleNamespace) -> None:
    """The template does react to the switch: the check above is not vacuous."""
    tok = gemma4_style.tok
    default = tok.apply_chat_template(
        [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert "<|think|>" in default
    assert "<|think|>" not in tok.decode(ChatFormat(tok).prompt_ids("s", "u")[0])


def test_canvas_ends_with_vllms_end_of_turn_and_pad(gemma4_style: SimpleNamespace) -> None:
    tok = gemma4_style.tok
    chat = ChatFormat(tok)
    assert [chat.eot_id] == gemma4_style.end
    assert chat.pad_id == tok.pad_token_id
    layout = resolve_layout(chat.encode, [("toxic", ("yes", "no"))], max_width=64)
    read = make_read(chat, layout, "system", "state", seed=1)
    n = len(layout.template_ids)
    assert read.canvas_ids[n] == chat.eot_id
    assert set(read.canvas_ids[n + 1 :]) == {chat.pad_id}
    assert read.prompt_ids[-len(chat.thought_ids) :] == chat.thought_ids


def test_demo_tokenizer_keeps_its_trained_format() -> None:
    """The demo model's tokenizer has no channel tokens: no thought block, its own EOT."""
    from transformers import AutoTokenizer

    from dgstream.workers.engine.models import TRAINED_DIRS

    tok = AutoTokenizer.from_pretrained(str(TRAINED_DIRS["demo"]))
    chat = ChatFormat(tok)
    assert chat.thought_ids == ()
    assert chat.eot_id == tok.convert_tokens_to_ids("<end_of_turn>")
    ids, shared = chat.prompt_ids("sys", "user text")
    assert ids[:shared] == chat.prefix_ids("sys")
    assert tok.decode(ids).endswith("<start_of_turn>model\n")
