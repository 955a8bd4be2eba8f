# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Every engine configuration of the GPU end-to-end tests, built on CPU.

The GPU tests (test_packed_kv_cache_offload_e2e.py) run only on GPU hosts. Here
each of their configurations goes through vLLM's own EngineArgs, the
connector's layout, the planner and the offloading spec the connector would
create, so that a wrong argument or connector option fails in CPU CI.
"""

import pytest

import tests.v1.worker.per_backend_kv_layout  # noqa: F401 (skips without that API)
import vllm.config.vllm as vllm_config_module
from tests.v1.worker.offload_e2e_configs import (
    CASES,
    GPU_BLOCK_SIZE,
    MAX_TOKENS,
    NUM_PROMPTS,
    SLIDING_WINDOW,
    engine_kwargs,
    full_blocks,
    offloading_spec_inputs,
    runner_env,
)
from tests.v1.worker.offload_round_trip import prompt_token_ids
from tests.v1.worker.test_packed_kv_cache_pipeline import layer_specs
from tests.v1.worker.tiny_hybrid_model import make_tiny_gpt_oss
from vllm.config import set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.core.kv_cache_utils import (
    _use_packed_kv_cache_config,
    get_kv_cache_configs,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

pytestmark = pytest.mark.cpu_test


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return str(make_tiny_gpt_oss(tmp_path_factory.mktemp("models") / "tiny-gpt-oss"))


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_gpu_e2e_configs_build(case, tiny_model, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    # The environment the GPU test gives the case: its model runner.
    for key, value in runner_env(case).items():
        monkeypatch.setenv(key, value)
    use_v2 = case.model_runner == "v2"
    # GPU hosts have Triton; this CPU process has it disabled, and the V2 runner's
    # config check refuses to go on without it. Past that gate the check is vLLM's
    # own: the features V2 does not support yet fail here, not on the GPU.
    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", True)

    baseline_config = EngineArgs(
        **engine_kwargs(case, tiny_model, offload=False)
    ).create_engine_config()
    assert baseline_config.kv_transfer_config is None
    assert baseline_config.use_v2_model_runner is use_v2

    config = EngineArgs(
        **engine_kwargs(case, tiny_model, offload=True)
    ).create_engine_config()
    assert config.use_v2_model_runner is use_v2
    assert config.attention_config.backend.name == case.attn_backend
    assert config.parallel_config.tensor_parallel_size == case.tensor_parallel_size
    assert config.cache_config.block_size == GPU_BLOCK_SIZE
    assert config.cache_config.enable_prefix_caching
    assert config.scheduler_config.disable_hybrid_kv_cache_manager is False

    connector = KVConnectorFactory.get_connector_class(config.kv_transfer_config)
    assert connector.__name__ == "OffloadingConnector"
    assert connector.get_required_kvcache_layout(config) == "HND"

    specs = layer_specs(config)
    page_bytes = next(iter(specs.values())).page_size_bytes
    with set_current_vllm_config(config):
        (kv_cache_config,) = get_kv_cache_configs(
            config, [specs], [256 * 2 * page_bytes]
        )
        assert _use_packed_kv_cache_config(config, kv_cache_config.kv_cache_groups)
        # The spec the connector creates from the extra config: every option read.
        spec = OffloadingSpecFactory.create_spec(
            *offloading_spec_inputs(config, kv_cache_config)
        )
    assert type(spec).__name__ == "CPUOffloadingSpec"
    assert spec.eviction_policy == "lru"
    offloaded_block_size = case.cpu_block_size or GPU_BLOCK_SIZE
    # GPU blocks per offloaded block (named blocks_per_chunk from vLLM 0.26).
    per_chunk = getattr(spec, "blocks_per_chunk", None) or spec.block_size_factor
    assert per_chunk == offloaded_block_size // GPU_BLOCK_SIZE
    assert spec.num_blocks > 0


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_gpu_e2e_prompts_hit_alike(case, tiny_model):
    """The GPU test compares tokens after a CPU reload with tokens after a GPU
    prefix hit: its prompts must make both hits the same length, reach past the
    sliding window, fit the model length, and stay inside the tiny model's vocab."""
    import json
    from pathlib import Path

    offloaded = case.cpu_block_size or GPU_BLOCK_SIZE
    prompts = prompt_token_ids(
        NUM_PROMPTS, GPU_BLOCK_SIZE, offloaded, full_blocks=full_blocks(offloaded)
    )
    vocab = json.loads((Path(tiny_model) / "config.json").read_text())["vocab_size"]
    max_model_len = engine_kwargs(case, tiny_model, offload=False)["max_model_len"]
    for prompt in prompts:
        # Both leave at least the last token to compute and hit whole blocks.
        gpu_hit = (len(prompt) - 1) // GPU_BLOCK_SIZE * GPU_BLOCK_SIZE
        offload_hit = (len(prompt) - 1) // offloaded * offloaded
        assert gpu_hit == offload_hit > 0
        # A sliding-window group hits only when a window's worth of blocks is
        # cached before the hit's end: both hits must reach that far.
        assert gpu_hit >= SLIDING_WINDOW
        assert len(prompt) > SLIDING_WINDOW
        assert len(prompt) + MAX_TOKENS <= max_model_len
        assert max(prompt) < vocab
    assert len({tuple(p[:1]) for p in prompts}) == len(prompts), "prompts share a block"
