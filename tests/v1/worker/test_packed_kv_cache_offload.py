# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The CPU-offload data path on packed (cross-layer) KV caches, on CPU.

The OffloadingConnector worker registers the packed caches of a hybrid model
as one canonical block-major byte tensor with a full-row reference per KV
cache group, and moves whole block rows. After a store and a load of some
blocks, every layer's K and V must read back exactly through its view, and sit
in the page in physical (HND) order, which is what the kernels read
(vllm#47054).
"""

import inspect

import pytest
import torch

import tests.v1.worker.per_backend_kv_layout  # noqa: F401 (skips without that API)
from tests.v1.worker.offload_e2e_configs import offloading_spec_inputs
from tests.v1.worker.per_backend_kv_layout import FlashInferBackend, flashinfer_param
from tests.v1.worker.test_packed_kv_cache_pipeline import gpt_oss_offload_config
from tests.v1.worker.test_packed_kv_cache_reshape import kv_cache_layout
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
    OffloadingConnectorWorker,
)
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.worker.gpu.attn_utils import (
    _allocate_kv_cache,
    _reshape_attention_kv_cache,
)

# No distributed state or engine here: vLLM's per-test global cleanup (~0.7 s a case
# on CPU) is skipped, as its conftest allows for such unit tests.
pytestmark = [pytest.mark.cpu_test, pytest.mark.skip_global_cleanup]

NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE = 8, 16, 4, 64


class RecordingCPUOffloadingSpec(CPUOffloadingSpec):
    """The real spec, except for the transfer worker it creates: that worker needs
    CUDA (pinned host memory, streams, a CUDA copy kernel). Registration, which is
    what this test checks, is all the connector's own code."""

    canonical = None

    def get_worker(self, kv_caches):
        self.canonical = kv_caches
        return None

    def get_handlers(self, kv_caches):  # the same hand-off up to vLLM 0.24
        self.canonical = kv_caches
        return iter(())


def register_kv_caches(
    vllm_config, kv_cache_config, views
) -> RecordingCPUOffloadingSpec:
    """The connector worker's registration of VIEWS; returns the spec, which holds
    the canonical tensors the transfer worker would get."""
    spec = RecordingCPUOffloadingSpec(
        *offloading_spec_inputs(vllm_config, kv_cache_config)
    )
    # From vLLM 0.26 the worker takes the KV cache config beside the spec.
    if "kv_cache_config" in inspect.signature(OffloadingConnectorWorker).parameters:
        worker = OffloadingConnectorWorker(spec, kv_cache_config)
    else:
        worker = OffloadingConnectorWorker(spec)
    worker.register_kv_caches(views)
    return spec


@pytest.fixture(autouse=True)
def hnd_layout():
    """The layout the OffloadingConnector requires."""
    with kv_cache_layout("HND"):
        yield


@pytest.mark.parametrize(
    "backend",
    [
        pytest.param(FlashAttentionBackend, id="FLASH_ATTN"),
        flashinfer_param(FlashInferBackend, id="FLASHINFER"),
    ],
)
def test_offload_round_trip_on_packed_views(tmp_path, backend):
    common = dict(
        block_size=BLOCK_SIZE,
        num_kv_heads=NUM_KV_HEADS,
        head_size=HEAD_SIZE,
        dtype=torch.bfloat16,
    )
    sliding = SlidingWindowSpec(sliding_window=128, **common)
    full = FullAttentionSpec(**common)
    groups = [
        KVCacheGroupSpec(["layers.0", "layers.2"], sliding),
        KVCacheGroupSpec(["layers.1", "layers.3"], full),
    ]
    vllm_config = gpt_oss_offload_config(tmp_path)
    vllm_config.cache_config.num_gpu_blocks_override = NUM_BLOCKS
    kv_cache_config = get_kv_cache_config_from_groups(vllm_config, groups, 1 << 30)
    page_bytes = full.page_size_bytes
    block_stride = len(groups) * page_bytes
    assert {t.block_stride for t in kv_cache_config.kv_cache_tensors} == {block_stride}

    raw = _allocate_kv_cache(kv_cache_config, {}, torch.device("cpu"))
    shape = backend.get_kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    order = backend.get_kv_cache_stride_order()
    placement = {
        name: (t.offset, t.block_stride)
        for t in kv_cache_config.kv_cache_tensors
        for name in t.shared_by
    }
    spec_of = {name: g.kv_cache_spec for g in groups for name in g.layer_names}
    views = {
        name: _reshape_attention_kv_cache(
            raw[name], spec_of[name], shape, order, NUM_BLOCKS, placement[name]
        )
        for name in sorted(placement)
    }

    spec = register_kv_caches(vllm_config, kv_cache_config, views)
    (canonical,) = spec.canonical.tensors
    rows = canonical.tensor
    assert rows.dtype == torch.int8
    assert tuple(rows.shape) == (NUM_BLOCKS, block_stride)
    assert rows.data_ptr() == next(iter(raw.values())).data_ptr()
    # Each group moves whole block rows: the pages of every layer packed there.
    assert len(spec.canonical.group_data_refs) == len(groups)
    for refs in spec.canonical.group_data_refs:
        assert [(r.tensor_idx, r.page_size_bytes) for r in refs] == [(0, block_stride)]

    # The block pool gives the two groups disjoint block ids.
    owned = {0: [1, 2, 3], 1: [4, 5, 6]}
    group_of = {name: i for i, g in enumerate(groups) for name in g.layer_names}
    gen = torch.Generator().manual_seed(0)
    truth = {}
    for name, view in views.items():
        blocks = owned[group_of[name]]
        truth[name] = torch.randn((len(blocks), *shape[1:]), generator=gen).to(
            torch.bfloat16
        )
        view[blocks] = truth[name]

    # Store some rows to host memory (the byte copy the CUDA worker does), scribble
    # over them on the device side, load them back.
    moved = [1, 3, 5, 6]
    host = rows[moved].clone()
    rows[moved] = torch.randint(-128, 127, host.shape, dtype=torch.int8, generator=gen)
    rows[moved] = host

    for name, view in views.items():
        blocks = owned[group_of[name]]
        assert torch.equal(view[blocks], truth[name]), f"{name} did not round-trip"
        # ...and the bytes are where the kernels look for them: the layer's page,
        # in physical order.
        offset, _ = placement[name]
        page = rows[blocks, offset : offset + page_bytes].contiguous()
        physical = page.view(torch.bfloat16).view(
            len(blocks), *(shape[i] for i in order[1:])
        )
        assert torch.equal(physical, truth[name].permute(*order)), name
