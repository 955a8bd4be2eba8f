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
the connector's store and load counters must move. Each engine's workers
report the KV cache they hold: the #47054 engine's must be packed block rows
(both KV cache groups per row, every layer a view into one allocation) in HND
order, the baseline's per-layer. The configurations live in
offload_e2e_configs.py; a CPU test builds each of them. Run with
``pytest --forked``.

VLLM_OFFLOAD_E2E_MODEL names a real checkpoint (e.g. openai/gpt-oss-20b) where
the host has one; by default a tiny GPT-OSS with random weights is generated
(``python -m tests.v1.worker.offload_e2e_configs FOLDER`` makes them ahead, for
VLLM_OFFLOAD_E2E_MODELS=FOLDER).
"""

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.v1.worker.offload_e2e_configs import (
    CASES,
    FILLER_TOKENS,
    GPU_BLOCK_SIZE,
    MAX_TOKENS,
    NUM_PROMPTS,
    OffloadCase,
    engine_kwargs,
    full_blocks,
    runner_env,
    tiny_model,
)
from tests.v1.worker.offload_round_trip import (
    KV_CACHE_INSPECTION,
    PackedKVCache,
    prompt_token_ids,
    run_round_trip,
)
from vllm.platforms import current_platform

pytestmark = pytest.mark.skipif(
    not current_platform.is_cuda(),
    reason="needs an NVIDIA GPU: CPU KV offloading runs only from CUDA-alike or "
    "XPU GPUs",
)


@pytest.fixture(scope="module")
def model_for(tmp_path_factory) -> Callable[[OffloadCase], str]:
    """The model of a case: the named checkpoint, or the tiny GPT-OSS with the
    case's heads, generated once per head count (in VLLM_OFFLOAD_E2E_MODELS where
    it names a folder of them made ahead, for hosts without the packages that
    generate them)."""
    named = os.environ.get("VLLM_OFFLOAD_E2E_MODEL")
    made_ahead = os.environ.get("VLLM_OFFLOAD_E2E_MODELS")
    folder = Path(made_ahead) if made_ahead else tmp_path_factory.mktemp("models")

    def model(case: OffloadCase) -> str:
        return named or str(tiny_model(case, folder))

    return model


def packed_kv_cache(case: OffloadCase, model: str) -> PackedKVCache:
    """The packed cache each worker of CASE's #47054 engine must hold, from the
    model's own config (not vLLM's reading of it)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    kwargs = engine_kwargs(case, model, offload=True)
    assert config.num_key_value_heads % case.tensor_parallel_size == 0
    return PackedKVCache(
        backend=case.attn_backend,
        layer_types=tuple(config.layer_types),
        num_kv_heads=config.num_key_value_heads // case.tensor_parallel_size,
        head_size=config.head_dim,
        block_size=kwargs["block_size"],
        dtype_bytes=getattr(torch, kwargs["dtype"]).itemsize,
    )


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_offload_reload_matches_baseline(case, model_for, monkeypatch):
    from vllm import LLM
    from vllm.v1.attention.backends.fa_utils import flash_attn_supports_sinks

    if case.tensor_parallel_size > torch.cuda.device_count():
        pytest.skip(f"needs {case.tensor_parallel_size} GPUs")
    if case.attn_backend == "FLASH_ATTN" and not flash_attn_supports_sinks():
        pytest.skip("GPT-OSS attention sinks need FlashAttention 3 (Hopper) or newer")
    for key, value in runner_env(case).items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    model = model_for(case)

    offloaded_block_size = case.cpu_block_size or GPU_BLOCK_SIZE
    prompts = prompt_token_ids(
        NUM_PROMPTS,
        GPU_BLOCK_SIZE,
        offloaded_block_size,
        full_blocks=full_blocks(offloaded_block_size),
    )
    trip = run_round_trip(
        lambda offload: LLM(
            **engine_kwargs(
                case, model, offload=offload, worker_extension_cls=KV_CACHE_INSPECTION
            )
        ),
        prompts,
        MAX_TOKENS,
        filler_tokens=FILLER_TOKENS,
        packed=packed_kv_cache(case, model),
    )
    trip.check()
