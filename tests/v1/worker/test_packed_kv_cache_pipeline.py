# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The packed KV cache of vllm#47054, built the way the engine builds it, on CPU.

A GPT-OSS-shaped model (sliding-window and full-attention layers, so two KV
cache groups) with the OffloadingConnector and ``enable_cross_layers_blocks``:
vLLM's planner packs the groups' pages into shared block rows, the connector
makes the layout HND, and both model runners allocate and reshape the caches.
Every view must be the attention backend's logical shape over the page's bytes
in physical order. Fails without the fix in ``_reshape_attention_kv_cache``.

The planner packs for any connector configured with
``enable_cross_layers_blocks``, and the layout is whatever the connector asks
for, so the same pipeline runs for every connector whose layout is HND: P/D
disaggregation (NixlConnector, MooncakeConnector), MultiConnector over them,
and any connector under ``VLLM_KV_CACHE_LAYOUT=HND``.
"""

import pytest
import torch

import tests.v1.worker.per_backend_kv_layout  # noqa: F401 (skips without that API)
from tests.v1.worker.offload_e2e_configs import (
    offload_transfer_config,
    tiny_gpt_oss_config,
)
from tests.v1.worker.per_backend_kv_layout import FlashInferBackend, flashinfer_param
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.attention.backends.flex_attention import FlexAttentionBackend
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
from vllm.v1.attention.backends.utils import get_kv_cache_layout, set_kv_cache_layout
from vllm.v1.core.kv_cache_utils import (
    _use_packed_kv_cache_config,
    get_kv_cache_configs,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from vllm.v1.worker.gpu.attn_utils import _allocate_kv_cache, _reshape_kv_cache
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.utils import AttentionGroup, prepare_kernel_block_sizes

# No distributed state or engine here: vLLM's per-test global cleanup (~0.7 s a case
# on CPU) is skipped, as its conftest allows for such unit tests.
pytestmark = [pytest.mark.cpu_test, pytest.mark.skip_global_cleanup]

BLOCK_SIZE = 16
NUM_KV_HEADS = 4  # != BLOCK_SIZE: see test_packed_kv_cache_reshape.py
HEAD_SIZE = 64
NUM_BLOCKS = 32

# The backends whose HND stride order is not the identity, as the layers of a
# hybrid model on a GPU host may select them.
BACKENDS = [
    pytest.param(FlashAttentionBackend, id="FLASH_ATTN"),
    pytest.param(TritonAttentionBackend, id="TRITON_ATTN"),
    pytest.param(FlexAttentionBackend, id="FLEX_ATTENTION"),
    flashinfer_param(FlashInferBackend, id="FLASHINFER"),
]


# Connectors of 0.25.1 configured with enable_cross_layers_blocks, by the name
# vLLM registers them under, with the environment the case sets. Each asks for
# HND (get_required_kvcache_layout), or the environment forces it. (A connector
# without hybrid-allocator support, e.g. ExampleConnector, turns the hybrid KV
# cache manager off: one group, nothing packed.)
CONNECTORS = {
    "OffloadingConnector": {},
    "NixlConnector": {},
    "MooncakeConnector": {},
    "MultiConnector": {},
    "SimpleCPUOffloadConnector": {"VLLM_KV_CACHE_LAYOUT": "HND"},  # asks for none
}


def connector_transfer_config(connector: str) -> KVTransferConfig:
    """CONNECTOR as a user would configure it, with enable_cross_layers_blocks."""
    if connector == "OffloadingConnector":  # the configuration of the report
        return offload_transfer_config(cpu_block_size=None)
    extra: dict = {"enable_cross_layers_blocks": "True"}
    if connector == "MultiConnector":  # P/D transfer plus CPU offloading
        offload = offload_transfer_config(cpu_block_size=None)
        extra["connectors"] = [
            {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
            {
                "kv_connector": offload.kv_connector,
                "kv_role": offload.kv_role,
                "kv_connector_extra_config": offload.kv_connector_extra_config,
            },
        ]
    return KVTransferConfig(
        kv_connector=connector, kv_role="kv_both", kv_connector_extra_config=extra
    )


def gpt_oss_offload_config(
    path,
    cache_dtype: str = "auto",
    cross_layers: bool = True,
    connector: str = "OffloadingConnector",
) -> VllmConfig:
    """The #47054 configuration on the GPT-OSS-shaped config written to PATH
    (with CONNECTOR in place of the OffloadingConnector, where given)."""
    transfer_config = connector_transfer_config(connector)
    transfer_config.kv_connector_extra_config["enable_cross_layers_blocks"] = str(
        cross_layers
    )
    return VllmConfig(
        model_config=ModelConfig(
            model=tiny_gpt_oss_config(path, HEAD_SIZE, NUM_KV_HEADS),
            skip_tokenizer_init=True,
            max_model_len=128,
            dtype="bfloat16",
        ),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, cache_dtype=cache_dtype),
        device_config=DeviceConfig(device="cpu"),
        kv_transfer_config=transfer_config,
    )


@pytest.fixture(params=list(CONNECTORS))
def offload_config(request, tmp_path, monkeypatch) -> VllmConfig:
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    for name, value in CONNECTORS[request.param].items():
        monkeypatch.setenv(name, value)
    return gpt_oss_offload_config(tmp_path, connector=request.param)


def required_layout(vllm_config: VllmConfig) -> str | None:
    """The layout the configured connector class itself asks for."""
    transfer_config = vllm_config.kv_transfer_config
    connector_cls = KVConnectorFactory.get_connector_class(transfer_config)
    return connector_cls.get_required_kvcache_layout(vllm_config)


def layer_specs(vllm_config: VllmConfig) -> dict:
    """The per-layer KV cache specs, as the model's attention layers declare them.

    (Built here rather than by instantiating the model: on a CPU host the layers
    would pick the CPU attention backend, which sets its own layout.)
    """
    model_config = vllm_config.model_config
    hf_config = model_config.hf_text_config
    common = dict(
        block_size=vllm_config.cache_config.block_size,
        num_kv_heads=model_config.get_num_kv_heads(vllm_config.parallel_config),
        head_size=model_config.get_head_size(),
        dtype=model_config.dtype,
    )
    return {
        f"model.layers.{i}.self_attn.attn": (
            SlidingWindowSpec(sliding_window=hf_config.sliding_window, **common)
            if layer_type == "sliding_attention"
            else FullAttentionSpec(**common)
        )
        for i, layer_type in enumerate(hf_config.layer_types)
    }


def reshape_v2(
    kv_cache_config, attn_groups, kernel_block_sizes, device="cpu", cache_dtype="auto"
):
    raw = _allocate_kv_cache(kv_cache_config, {}, torch.device(device))
    views = _reshape_kv_cache(
        attn_groups=[group for groups in attn_groups for group in groups],
        kv_cache_raw_tensors=raw,
        cache_dtype=cache_dtype,
        kernel_block_sizes=kernel_block_sizes,
        shared_kv_cache_layers={},
        kv_cache_config=kv_cache_config,
    )
    return raw, views


def reshape_v1(kv_cache_config, attn_groups, kernel_block_sizes, vllm_config):
    """GPUModelRunner's own allocation and reshape methods (the runner GPT-OSS uses),
    on a runner that is not initialised, carrying only the attributes those methods
    read: constructing a whole GPUModelRunner needs a CUDA device."""
    owner = object.__new__(GPUModelRunner)
    owner.device = torch.device("cpu")
    owner.runner_only_attn_layers = set()
    owner.kv_cache_config = kv_cache_config
    owner.attn_groups = attn_groups
    owner.cache_config = vllm_config.cache_config
    raw = owner._allocate_kv_cache_tensors(kv_cache_config)
    return raw, owner._reshape_kv_cache_tensors(raw, kernel_block_sizes)


def allocate_and_reshape(
    runner, kv_cache_config, attn_groups, kernel_block_sizes, vllm_config
):
    """The raw tensors and per-layer views, through the v2 model runner's helpers or
    the v1 runner's own methods (RUNNER "v2" or "v1")."""
    if runner == "v2":
        cache_dtype = vllm_config.cache_config.cache_dtype
        return reshape_v2(
            kv_cache_config, attn_groups, kernel_block_sizes, cache_dtype=cache_dtype
        )
    return reshape_v1(kv_cache_config, attn_groups, kernel_block_sizes, vllm_config)


@pytest.mark.parametrize("runner", ["v2", "v1"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_offload_packed_kv_cache_views(offload_config, runner, backend):
    specs = layer_specs(offload_config)
    page_bytes = next(iter(specs.values())).page_size_bytes
    with set_current_vllm_config(offload_config):
        set_kv_cache_layout(None)  # no override: the connector decides
        try:
            forced = CONNECTORS[offload_config.kv_transfer_config.kv_connector]
            layout = forced.get("VLLM_KV_CACHE_LAYOUT") or required_layout(
                offload_config
            )
            assert get_kv_cache_layout() == layout == "HND"
            stride_order = backend.get_kv_cache_stride_order()

            (kv_cache_config,) = get_kv_cache_configs(
                # Memory for NUM_BLOCKS rows of one page per group (two groups).
                offload_config,
                [specs],
                [NUM_BLOCKS * 2 * page_bytes],
            )
            groups = kv_cache_config.kv_cache_groups
            assert sorted(type(g.kv_cache_spec).__name__ for g in groups) == [
                "FullAttentionSpec",
                "SlidingWindowSpec",
            ]
            assert _use_packed_kv_cache_config(offload_config, groups)
            # One page per group in each block row, side by side.
            tensors = kv_cache_config.kv_cache_tensors
            assert {t.block_stride for t in tensors} == {len(groups) * page_bytes}
            assert sorted(t.offset for t in tensors) == [0, page_bytes]
            assert kv_cache_config.num_blocks == NUM_BLOCKS

            attn_groups = [
                [AttentionGroup(backend, list(g.layer_names), g.kv_cache_spec, i)]
                for i, g in enumerate(groups)
            ]
            kernel_block_sizes = prepare_kernel_block_sizes(
                kv_cache_config, attn_groups
            )
            raw, views = allocate_and_reshape(
                runner, kv_cache_config, attn_groups, kernel_block_sizes, offload_config
            )
        finally:
            get_kv_cache_layout.cache_clear()

    placement = {
        name: (t.offset, t.block_stride) for t in tensors for name in t.shared_by
    }
    for group_id, group in enumerate(groups):
        kernel_block_size = kernel_block_sizes[group_id]
        for name in group.layer_names:
            view, layer_raw = views[name], raw[name]
            offset, block_stride = placement[name]
            num_blocks = layer_raw.numel() // block_stride
            shape = backend.get_kv_cache_shape(
                num_blocks * (BLOCK_SIZE // kernel_block_size),
                kernel_block_size,
                NUM_KV_HEADS,
                HEAD_SIZE,
            )
            assert tuple(view.shape) == tuple(shape), name
            assert view.untyped_storage().data_ptr() == (
                layer_raw.untyped_storage().data_ptr()
            )

            # Fill the view; exactly this layer's page of each block row changes,
            # and those bytes, read in the physical order, are the view permuted.
            layer_raw.zero_()
            view.copy_((torch.arange(view.numel()) % 251 + 1).view(view.shape))
            rows = layer_raw.view(-1, block_stride)
            page = rows[:, offset : offset + page_bytes]
            others = torch.cat([rows[:, :offset], rows[:, offset + page_bytes :]], 1)
            assert not others.any(), f"{name} wrote outside its page"
            physical = page.contiguous().view(view.dtype)
            physical = physical.view(num_blocks, *(shape[i] for i in stride_order[1:]))
            assert torch.equal(physical, view.permute(*stride_order)), name
            layer_raw.zero_()
