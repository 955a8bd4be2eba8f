# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Which connectors do not reach the packed KV cache of vllm#47054.

``enable_cross_layers_blocks`` packs a hybrid model's KV cache groups into
shared block rows only while the hybrid KV cache manager is on, and vLLM turns
it off for a connector without hybrid-allocator support (``SupportsHMA``):
the sliding-window layers are then planned as full attention, in one group,
and nothing is packed. test_packed_kv_cache_pipeline.py covers the connectors
that do reach it.
"""

import pytest

import tests.v1.worker.per_backend_kv_layout  # noqa: F401 (skips without that API)
from tests.v1.worker.test_packed_kv_cache_pipeline import (
    NUM_BLOCKS,
    gpt_oss_offload_config,
    layer_specs,
)
from vllm.config import set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
from vllm.v1.core.kv_cache_utils import (
    _use_packed_kv_cache_config,
    get_kv_cache_configs,
)

# No distributed state or engine here: vLLM's per-test global cleanup (~0.7 s a case
# on CPU) is skipped, as its conftest allows for such unit tests.
pytestmark = [pytest.mark.cpu_test, pytest.mark.skip_global_cleanup]


def test_a_connector_without_hma_support_packs_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    vllm_config = gpt_oss_offload_config(tmp_path, connector="ExampleConnector")
    transfer_config = vllm_config.kv_transfer_config
    assert transfer_config.kv_connector_extra_config["enable_cross_layers_blocks"]
    connector_cls = KVConnectorFactory.get_connector_class(transfer_config)
    assert not issubclass(connector_cls, SupportsHMA)
    assert vllm_config.scheduler_config.disable_hybrid_kv_cache_manager

    specs = layer_specs(vllm_config)
    page_bytes = next(iter(specs.values())).page_size_bytes
    with set_current_vllm_config(vllm_config):
        (kv_cache_config,) = get_kv_cache_configs(
            vllm_config, [specs], [NUM_BLOCKS * len(specs) * page_bytes]
        )
    groups = kv_cache_config.kv_cache_groups
    assert [type(g.kv_cache_spec).__name__ for g in groups] == ["FullAttentionSpec"]
    assert not _use_packed_kv_cache_config(vllm_config, groups)
    assert all(t.block_stride == 0 for t in kv_cache_config.kv_cache_tensors)
