# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Quantized KV cache dtypes on packed (cross-layer) KV caches, on CPU.

Settles suspect 3 of the fork's packed-KV audit: the #47054 configuration
(GPT-OSS-shaped, OffloadingConnector with ``enable_cross_layers_blocks``, HND)
with every KV cache dtype that FlashAttention or Triton takes. For each, vLLM's
planner, both runners' allocation and reshape, and the connector worker's
registration must give every layer a view that covers exactly its own page.

Per-token-head dtypes (``int8/fp8/int4_per_token_head``, Triton only) keep one
float32 scale per (token, head) in padding after each head's data; Triton's
``_ensure_scale_caches`` carves those scales out of the view's storage. Packed,
the scales must still lie in the layer's own padding; in 0.25.1 they do not.
"""

import dataclasses

import pytest
import torch

import tests.v1.worker.per_backend_kv_layout  # noqa: F401 (skips without that API)
from tests.v1.worker.test_packed_kv_cache_offload import register_kv_caches
from tests.v1.worker.test_packed_kv_cache_pipeline import (
    BLOCK_SIZE,
    HEAD_SIZE,
    NUM_BLOCKS,
    NUM_KV_HEADS,
    allocate_and_reshape,
    gpt_oss_offload_config,
    layer_specs,
)
from tests.v1.worker.test_packed_kv_cache_scales import mark_bytes, scale_bytes_of
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
)
from vllm.v1.attention.backends.utils import get_kv_cache_layout, set_kv_cache_layout
from vllm.v1.core.kv_cache_utils import (
    _use_packed_kv_cache_config,
    get_kv_cache_configs,
)
from vllm.v1.kv_cache_interface import (
    get_kv_quant_mode,
    kv_cache_uses_per_token_head_scales,
)
from vllm.v1.worker.utils import AttentionGroup, prepare_kernel_block_sizes

# No distributed state or engine here: vLLM's per-test global cleanup (~0.7 s a case
# on CPU) is skipped, as its conftest allows for such unit tests.
pytestmark = [pytest.mark.cpu_test, pytest.mark.skip_global_cleanup]

# The planner refuses this one for any sliding-window + full-attention model
# (test_int4_per_token_head_is_refused_with_sliding_window), packed or not.
INT4 = "int4_per_token_head"
# FlashAttention lists only unquantized dtypes; it takes fp8 / fp8_e4m3 on FA3
# (Hopper), the setting of #47054. Triton's list is asked of the class.
CASES = [
    (FlashAttentionBackend, d)
    for d in [*FlashAttentionBackend.supported_kv_cache_dtypes, "fp8", "fp8_e4m3"]
] + [
    (TritonAttentionBackend, d)
    for d in TritonAttentionBackend.supported_kv_cache_dtypes
    if d != INT4
]
PER_TOKEN_HEAD_DTYPES = [
    d
    for d in TritonAttentionBackend.supported_kv_cache_dtypes
    if kv_cache_uses_per_token_head_scales(d) and d != INT4
]


def build_views(vllm_config: VllmConfig, backend, runner: str):
    """Plan, allocate and reshape as the engine does; the layers' specs carry
    the cache dtype the way Attention.get_kv_cache_spec sets it."""
    cache_dtype = vllm_config.cache_config.cache_dtype
    specs = {
        name: dataclasses.replace(
            spec,
            dtype=kv_cache_dtype_str_to_dtype(cache_dtype, vllm_config.model_config),
            kv_quant_mode=get_kv_quant_mode(cache_dtype),
        )
        for name, spec in layer_specs(vllm_config).items()
    }
    page_bytes = next(iter(specs.values())).page_size_bytes
    with set_current_vllm_config(vllm_config):
        set_kv_cache_layout(None)  # no override: the connector decides
        try:
            assert get_kv_cache_layout() == "HND"
            (kv_cache_config,) = get_kv_cache_configs(
                vllm_config, [specs], [NUM_BLOCKS * 2 * page_bytes]
            )
            attn_groups = [
                [AttentionGroup(backend, list(g.layer_names), g.kv_cache_spec, i)]
                for i, g in enumerate(kv_cache_config.kv_cache_groups)
            ]
            kernel_block_sizes = prepare_kernel_block_sizes(
                kv_cache_config, attn_groups
            )
            raw, views = allocate_and_reshape(
                runner, kv_cache_config, attn_groups, kernel_block_sizes, vllm_config
            )
        finally:
            get_kv_cache_layout.cache_clear()
    return kv_cache_config, raw, views, page_bytes


def layer_pages(kv_cache_config, page_bytes: int, num_blocks: int):
    """name -> boolean byte mask of the layer's own pages in the raw backing."""
    masks = {}
    for t in kv_cache_config.kv_cache_tensors:
        stride = t.block_stride or page_bytes
        offset = t.offset if t.block_stride else 0
        mask = torch.zeros(num_blocks, stride, dtype=torch.bool)
        mask[:, offset : offset + page_bytes] = True
        for name in t.shared_by:
            masks[name] = mask.flatten()
    return masks


@pytest.mark.skipif(
    INT4 not in TritonAttentionBackend.supported_kv_cache_dtypes,
    reason=f"this vLLM has no {INT4} KV cache dtype",
)
@pytest.mark.parametrize("cross_layers", [False, True], ids=["per-layer", "packed"])
def test_int4_per_token_head_is_refused_with_sliding_window(tmp_path, cross_layers):
    """Settles int4_per_token_head: loud, not silent. SlidingWindowSpec sizes its
    page for unpacked heads (2 * head_size bytes per token and head) while
    FullAttentionSpec halves them for int4, so the two pages do not divide and
    the planner raises at start-up, with or without cross-layer blocks."""
    vllm_config = gpt_oss_offload_config(tmp_path, INT4, cross_layers)
    with pytest.raises(NotImplementedError, match="cannot be padded"):
        build_views(vllm_config, TritonAttentionBackend, "v1")


@pytest.mark.parametrize("runner", ["v2", "v1"])
@pytest.mark.parametrize(
    "backend,cache_dtype",
    [pytest.param(b, d, id=f"{b.get_name()}-{d}") for b, d in CASES],
)
def test_quantized_packed_views_and_registration(
    tmp_path, backend, cache_dtype, runner
):
    """Refutes suspect 3 for the views and the offload registration: with every
    dtype the packed view has the dtype's element type and padded head dim, covers
    exactly its layer's page of each block row, and registers as whole rows.

    The order of the middle dimensions under HND is #47054 itself, pinned by the
    regression modules; what is asserted here holds with and without that fix.
    """
    vllm_config = gpt_oss_offload_config(tmp_path, cache_dtype, cross_layers=True)
    kv_cache_config, raw, views, page_bytes = build_views(vllm_config, backend, runner)
    assert _use_packed_kv_cache_config(vllm_config, kv_cache_config.kv_cache_groups)
    block_stride = 2 * page_bytes
    assert {t.block_stride for t in kv_cache_config.kv_cache_tensors} == {block_stride}

    shape = backend.get_kv_cache_shape(
        NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, cache_dtype_str=cache_dtype
    )
    dtype = kv_cache_dtype_str_to_dtype(cache_dtype, vllm_config.model_config)
    own_page = layer_pages(kv_cache_config, page_bytes, NUM_BLOCKS)
    for name, view in views.items():
        assert view.dtype == dtype, name
        assert (view.shape[0], view.shape[-1]) == (shape[0], shape[-1]), name
        assert view.numel() * view.element_size() == NUM_BLOCKS * page_bytes, name
        backing = raw[name]
        backing.zero_()
        mark_bytes(view)
        written = backing != 0
        assert torch.equal(written, own_page[name]), f"{name} missed or left its page"
        backing.zero_()

    spec = register_kv_caches(vllm_config, kv_cache_config, views)
    (canonical,) = spec.canonical.tensors
    assert tuple(canonical.tensor.shape) == (NUM_BLOCKS, block_stride)
    assert canonical.tensor.data_ptr() == next(iter(raw.values())).data_ptr()
    for refs in spec.canonical.group_data_refs:
        assert [(r.tensor_idx, r.page_size_bytes) for r in refs] == [(0, block_stride)]


def check_scales_stay_in_their_layer(tmp_path, cache_dtype: str, cross_layers: bool):
    """The scale views Triton carves out of each layer's cache, planned and
    allocated by vLLM, must be that layer's own padding."""
    vllm_config = gpt_oss_offload_config(tmp_path, cache_dtype, cross_layers)
    kv_cache_config, raw, views, _ = build_views(
        vllm_config, TritonAttentionBackend, "v1"
    )
    specs = {
        name: group.kv_cache_spec
        for group in kv_cache_config.kv_cache_groups
        for name in group.layer_names
    }
    for name, view in views.items():
        raw[name].zero_()
        window = getattr(specs[name], "sliding_window", None)
        scale_bytes_of(raw[name], view, cache_dtype, window)


@pytest.mark.parametrize("cache_dtype", PER_TOKEN_HEAD_DTYPES)
def test_per_token_head_scales_stay_in_their_layer_unpacked(tmp_path, cache_dtype):
    """The control of test_packed_kv_cache_scales.py: without cross-layer blocks
    the scale views were right all along."""
    check_scales_stay_in_their_layer(tmp_path, cache_dtype, cross_layers=False)
