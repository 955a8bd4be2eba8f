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
from tests.v1.worker.offload_e2e_configs import (
    CASES,
    GPU_BLOCK_SIZE,
    engine_kwargs,
    offloading_spec_inputs,
)
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

    baseline = EngineArgs(**engine_kwargs(case, tiny_model, offload=False))
    assert baseline.create_engine_config().kv_transfer_config is None

    config = EngineArgs(
        **engine_kwargs(case, tiny_model, offload=True)
    ).create_engine_config()
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
