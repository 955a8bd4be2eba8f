# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The #47054 configuration end to end on a GPU: store to CPU, reload, same tokens.

A hybrid (sliding-window + full attention) model with the OffloadingConnector,
CPUOffloadingSpec and ``enable_cross_layers_blocks``, prefix caching and the
hybrid KV cache manager on, FlashAttention or Triton under HND. The round trip
is offload_round_trip.py, the harness the CPU engine test
(test_packed_kv_cache_offload_cpu_engine.py) runs with vLLM's Triton kernels on
CPU: greedy tokens after a reload from CPU must equal a baseline engine's after
a GPU prefix-cache hit of the same length, one request in flight at a time, and
the connector's store and load counters must move. The configurations live in
offload_e2e_configs.py; a CPU test builds each of them. Run with
``pytest --forked``.

VLLM_OFFLOAD_E2E_MODEL names a real checkpoint (e.g. openai/gpt-oss-20b) where
the host has one; by default a tiny GPT-OSS with random weights is generated.
"""

import os

import pytest
import torch

from tests.v1.worker.offload_e2e_configs import (
    CASES,
    FILLER_TOKENS,
    GPU_BLOCK_SIZE,
    MAX_TOKENS,
    NUM_PROMPTS,
    engine_kwargs,
    full_blocks,
    runner_env,
)
from tests.v1.worker.offload_round_trip import prompt_token_ids, run_round_trip
from tests.v1.worker.tiny_hybrid_model import make_tiny_gpt_oss
from vllm.platforms import current_platform

pytestmark = pytest.mark.skipif(
    not current_platform.is_cuda(),
    reason="needs an NVIDIA GPU: CPU KV offloading runs only from CUDA-alike or "
    "XPU GPUs",
)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    named = os.environ.get("VLLM_OFFLOAD_E2E_MODEL")
    if named:
        return named
    return str(make_tiny_gpt_oss(tmp_path_factory.mktemp("models") / "tiny-gpt-oss"))


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_offload_reload_matches_baseline(case, model, monkeypatch):
    from vllm import LLM
    from vllm.v1.attention.backends.fa_utils import flash_attn_supports_sinks

    if case.tensor_parallel_size > torch.cuda.device_count():
        pytest.skip(f"needs {case.tensor_parallel_size} GPUs")
    if case.attn_backend == "FLASH_ATTN" and not flash_attn_supports_sinks():
        pytest.skip("GPT-OSS attention sinks need FlashAttention 3 (Hopper) or newer")
    for key, value in runner_env(case).items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)

    offloaded_block_size = case.cpu_block_size or GPU_BLOCK_SIZE
    prompts = prompt_token_ids(
        NUM_PROMPTS,
        GPU_BLOCK_SIZE,
        offloaded_block_size,
        full_blocks=full_blocks(offloaded_block_size),
    )
    trip = run_round_trip(
        lambda offload: LLM(**engine_kwargs(case, model, offload=offload)),
        prompts,
        MAX_TOKENS,
        filler_tokens=FILLER_TOKENS,
    )
    trip.check()
