# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The embedded chat model of tiny_chat_model.py, checked without an engine.

`vllm serve` of the tiny GPT-OSS fails on /v1/chat/completions offline (harmony
needs tokens and a vocabulary download the tiny model lacks); the tiny Gemma 2
must render chats offline and still give vLLM's planner the GPT-OSS KV cache
plan: two groups, one sliding-window and one full attention.
"""

from pathlib import Path

import pytest
from transformers import AutoTokenizer

import tests.v1.worker.per_backend_kv_layout  # noqa: F401 (skips without that API)
from tests.v1.worker.tiny_chat_model import (
    IM_END,
    IM_START,
    SLIDING_WINDOW,
    make_tiny_chat_model,
)
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

pytestmark = pytest.mark.cpu_test

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello, world!"},
]
RENDERED = (
    f"{IM_START}system\nBe brief.{IM_END}\n"
    f"{IM_START}user\nHello, world!{IM_END}\n"
    f"{IM_START}assistant\n"
)


@pytest.fixture(scope="module")
def offline():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield


@pytest.fixture(scope="module")
def tiny_chat_model(offline, tmp_path_factory) -> str:
    return str(make_tiny_chat_model(tmp_path_factory.mktemp("models") / "tiny-chat"))


@pytest.fixture(scope="module")
def vllm_config(tiny_chat_model) -> VllmConfig:
    # The arguments `make serve` gives the embedded model.
    return EngineArgs(
        model=tiny_chat_model, dtype="bfloat16", max_model_len=1024
    ).create_engine_config()


def test_regeneration_is_a_no_op(tiny_chat_model):
    weights = Path(tiny_chat_model) / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert make_tiny_chat_model(Path(tiny_chat_model)) == Path(tiny_chat_model)
    assert weights.stat().st_mtime_ns == before


def test_chat_template_renders_offline(tiny_chat_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_model)
    text = tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )
    assert text == RENDERED
    ids = tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, return_dict=False
    )
    assert ids[0] == tokenizer.convert_tokens_to_ids(IM_START)  # one token each
    assert ids.count(tokenizer.convert_tokens_to_ids(IM_END)) == 2
    assert tokenizer.decode(ids) == RENDERED
    assert tokenizer.eos_token == IM_END


def test_vllm_renders_the_chat_offline(tiny_chat_model, vllm_config):
    """The way the chat endpoint renders it: vLLM's tokenizer and template lookup."""
    # Where vLLM 0.25.1 keeps them; other releases may have moved them.
    hf_renderer = pytest.importorskip("vllm.renderers.hf")
    get_tokenizer = pytest.importorskip("vllm.tokenizers").get_tokenizer

    model_config = vllm_config.model_config
    vllm_tokenizer = get_tokenizer(tiny_chat_model)
    content_format = hf_renderer.resolve_chat_template_content_format(
        None, None, "auto", vllm_tokenizer, model_config=model_config
    )
    assert content_format == "string"
    rendered = hf_renderer.safe_apply_chat_template(
        model_config,
        vllm_tokenizer,
        MESSAGES,
        tokenize=False,
        add_generation_prompt=True,
    )
    assert rendered == RENDERED


def test_two_kv_cache_groups(vllm_config):
    model_config = vllm_config.model_config
    hf_config = model_config.hf_text_config
    assert model_config.architecture == "Gemma2ForCausalLM"
    assert hf_config.sliding_window == SLIDING_WINDOW < model_config.max_model_len
    assert set(hf_config.layer_types) == {"sliding_attention", "full_attention"}
    assert not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager

    # The per-layer specs vLLM's Gemma 2 attention layers declare (gemma2.py: a
    # layer slides iff layer_types says so), then vLLM's own planner.
    common = dict(
        block_size=vllm_config.cache_config.block_size,
        num_kv_heads=model_config.get_num_kv_heads(vllm_config.parallel_config),
        head_size=model_config.get_head_size(),
        dtype=model_config.dtype,
    )
    specs = {
        f"model.layers.{i}.self_attn.attn": (
            SlidingWindowSpec(sliding_window=hf_config.sliding_window, **common)
            if layer_type == "sliding_attention"
            else FullAttentionSpec(**common)
        )
        for i, layer_type in enumerate(hf_config.layer_types)
    }
    page_bytes = next(iter(specs.values())).page_size_bytes
    with set_current_vllm_config(vllm_config):
        (kv_cache_config,) = get_kv_cache_configs(
            vllm_config, [specs], [64 * len(specs) * page_bytes]
        )

    groups = {
        type(group.kv_cache_spec): group.layer_names
        for group in kv_cache_config.kv_cache_groups
    }
    assert len(kv_cache_config.kv_cache_groups) == 2
    assert groups == {
        SlidingWindowSpec: [
            "model.layers.0.self_attn.attn",
            "model.layers.2.self_attn.attn",
        ],
        FullAttentionSpec: [
            "model.layers.1.self_attn.attn",
            "model.layers.3.self_attn.attn",
        ],
    }
