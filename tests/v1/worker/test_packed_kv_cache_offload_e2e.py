# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The #47054 configuration end to end on a GPU: store to CPU, reload, same tokens.

A hybrid (sliding-window + full attention) model with the OffloadingConnector,
CPUOffloadingSpec and ``enable_cross_layers_blocks``, prefix caching and the
hybrid KV cache manager on, FlashAttention or Triton under HND. Greedy tokens
after a reload from CPU must equal a baseline engine's tokens after a GPU prefix
cache hit (both compute only the suffix over cached K/V), and a load must really
have happened. The configurations live in offload_e2e_configs.py; a CPU test
builds each of them. Run with ``pytest --forked``.

VLLM_OFFLOAD_E2E_MODEL names a real checkpoint (e.g. openai/gpt-oss-20b) where
the host has one; by default a tiny GPT-OSS with random weights is generated.
"""

import gc
import os
import time

import pytest
import torch

from tests.v1.worker.offload_e2e_configs import (
    CASES,
    MAX_TOKENS,
    PROMPT_TOKEN_IDS,
    engine_kwargs,
    runner_env,
)
from tests.v1.worker.tiny_hybrid_model import make_tiny_gpt_oss
from vllm.platforms import current_platform

pytestmark = pytest.mark.skipif(
    not current_platform.is_cuda(),
    reason="needs an NVIDIA GPU: CPU KV offloading runs only from CUDA-alike or "
    "XPU GPUs",
)

RESET_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    named = os.environ.get("VLLM_OFFLOAD_E2E_MODEL")
    if named:
        return named
    return str(make_tiny_gpt_oss(tmp_path_factory.mktemp("models") / "tiny-gpt-oss"))


def _generate(llm, prompts):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs], [
        o.num_cached_tokens or 0 for o in outputs
    ]


def _reset_prefix_cache(llm):
    """Wait until the async stores have released their GPU blocks, then empty the
    GPU prefix cache: afterwards, cached tokens can only come from CPU."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    deadline = time.monotonic() + RESET_TIMEOUT_S
    while not llm.reset_prefix_cache():
        assert time.monotonic() < deadline, "stores to CPU did not finish in time"
        # One engine step lets the scheduler collect finished transfers.
        llm.generate(
            [TokensPrompt(prompt_token_ids=[1])],
            SamplingParams(max_tokens=1),
            use_tqdm=False,
        )


def _counter(name: str) -> float:
    import prometheus_client

    return sum(
        sample.value
        for metric in prometheus_client.REGISTRY.collect()
        if metric.name == name
        for sample in metric.samples
        if sample.name == name + "_total"
    )


def _release_gpu():
    """After the caller dropped its engine: free it before the next one starts."""
    from vllm.distributed import cleanup_dist_env_and_memory

    gc.collect()
    cleanup_dist_env_and_memory()


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_offload_reload_matches_baseline(case, model, monkeypatch):
    from vllm import LLM
    from vllm.inputs import TokensPrompt
    from vllm.v1.attention.backends.fa_utils import flash_attn_supports_sinks

    if case.tensor_parallel_size > torch.cuda.device_count():
        pytest.skip(f"needs {case.tensor_parallel_size} GPUs")
    if case.attn_backend == "FLASH_ATTN" and not flash_attn_supports_sinks():
        pytest.skip("GPT-OSS attention sinks need FlashAttention 3 (Hopper) or newer")
    for key, value in runner_env(case).items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in PROMPT_TOKEN_IDS]

    baseline = LLM(**engine_kwargs(case, model, offload=False))
    cold, _ = _generate(baseline, prompts)
    hit, hit_cached = _generate(baseline, prompts)  # from the GPU prefix cache
    assert all(hit_cached), "baseline did not hit its prefix cache"
    del baseline
    _release_gpu()

    llm = LLM(**engine_kwargs(case, model, offload=True))
    offload_cold, _ = _generate(llm, prompts)  # computes, then stores to CPU
    _reset_prefix_cache(llm)
    load_bytes_before = _counter("vllm:kv_offload_load_bytes")
    reloaded, reloaded_cached = _generate(llm, prompts)  # loads from CPU
    load_bytes = _counter("vllm:kv_offload_load_bytes") - load_bytes_before
    del llm
    _release_gpu()

    assert offload_cold == cold
    assert any(reloaded_cached), "nothing was loaded from CPU"
    assert load_bytes > 0, "the offload load-bytes metric did not move"
    assert reloaded == hit
