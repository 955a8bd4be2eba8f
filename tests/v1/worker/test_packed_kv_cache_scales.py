# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Per-token-head KV scales of packed (cross-layer) KV pages stay in their layer.

Triton's per-token-head KV cache dtypes (``int8_per_token_head``,
``fp8_per_token_head``) keep one float32 scale per (token, head) in padding after
each head's K and V, and ``TritonAttentionImpl._ensure_scale_caches`` carves scale
views out of the cache view's storage. In a packed block row each layer's page
starts at its own offset and blocks are a whole row apart; vLLM 0.24-0.25 built the
scale views from offset 0 with one page per block, so with cross-layer KV blocks
(the OffloadingConnector configuration of vllm#47054) every layer got the same scale
bytes and layers overwrote each other's scales, silently.

Driven through whichever KV cache layout API this vLLM has, as in
test_packed_kv_cache_layer_views.py: ``_reshape_attention_kv_cache`` with Triton's
padded HND shape up to 0.26, ``create_kv_cache_views`` with ``BLHNC`` after the
layout rewrite (RFC #42082).
"""

from math import prod

import pytest
import torch

from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
from vllm.v1 import kv_cache_interface
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    SlidingWindowSpec,
    get_kv_quant_mode,
)

# No distributed state or engine here: vLLM's per-test global cleanup (~0.7 s a case
# on CPU) is skipped, as its conftest allows for such unit tests.
pytestmark = [pytest.mark.cpu_test, pytest.mark.skip_global_cleanup]

NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE = 6, 16, 4, 64
NUM_QUERY_HEADS = 8
NUM_LAYERS = 4
SLIDING_WINDOW = 128
PER_TOKEN_HEAD_DTYPES = [
    d
    for d in ("int8_per_token_head", "fp8_per_token_head")
    if d in TritonAttentionBackend.supported_kv_cache_dtypes
]
HAS_LAYOUT_API = hasattr(kv_cache_interface, "create_kv_cache_views")


def mark_bytes(tensor: torch.Tensor) -> None:
    """Set every byte the tensor covers to a non-zero value, whatever its dtype."""
    size = tensor.element_size()
    as_int = {1: torch.int8, 2: torch.int16, 4: torch.int32}[size]
    tensor.view(as_int).fill_(int("11" * size, 16))


def gpt_oss_like_specs(cache_dtype: str) -> list:
    """Sliding-window and full attention layers alternating, with the cache dtype
    set the way the attention layers set it."""
    common = dict(
        block_size=BLOCK_SIZE,
        num_kv_heads=NUM_KV_HEADS,
        head_size=HEAD_SIZE,
        dtype=kv_cache_dtype_str_to_dtype(cache_dtype, None),
        kv_quant_mode=get_kv_quant_mode(cache_dtype),
    )
    specs = [
        SlidingWindowSpec(sliding_window=SLIDING_WINDOW, **common)
        if layer % 2 == 0
        else FullAttentionSpec(**common)
        for layer in range(NUM_LAYERS)
    ]
    if HAS_LAYOUT_API:  # the backend adds the scales' padding to the spec
        specs = [TritonAttentionBackend.customize_spec(spec) for spec in specs]
    return specs


def packed_views(specs, cache_dtype: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One int8 allocation of NUM_BLOCKS rows, each holding every layer's page, and
    the per-layer views the attention layers get."""
    page_bytes = specs[0].page_size_bytes
    block_stride = len(specs) * page_bytes
    raw = torch.zeros(NUM_BLOCKS * block_stride, dtype=torch.int8)
    if HAS_LAYOUT_API:
        from vllm.v1.kv_cache_interface import (
            KVCacheLayout,
            KVCacheTensor,
            create_kv_cache_views,
        )

        tensor = KVCacheTensor(
            size=raw.numel(),
            layers=[f"model.layers.{i}.self_attn.attn" for i in range(len(specs))],
            layer_stride=page_bytes,
            block_stride=block_stride,
        )
        views = create_kv_cache_views(
            raw, specs[0], NUM_BLOCKS, KVCacheLayout.BLHNC, tensor
        )
        return raw, views

    from vllm.v1.attention.backends.utils import (
        get_kv_cache_layout,
        set_kv_cache_layout,
    )
    from vllm.v1.worker.gpu.attn_utils import _reshape_attention_kv_cache

    set_kv_cache_layout("HND")  # what the OffloadingConnector requires
    get_kv_cache_layout.cache_clear()
    try:
        shape = TritonAttentionBackend.get_kv_cache_shape(
            NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, cache_dtype_str=cache_dtype
        )
        order = TritonAttentionBackend.get_kv_cache_stride_order()
    finally:
        set_kv_cache_layout(None)
        get_kv_cache_layout.cache_clear()
    assert prod(shape[1:]) * specs[0].dtype.itemsize == page_bytes
    views = [
        _reshape_attention_kv_cache(
            raw, spec, shape, order, NUM_BLOCKS, (layer * page_bytes, block_stride)
        )
        for layer, spec in enumerate(specs)
    ]
    return raw, views


def padding_of(raw: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """Byte mask of RAW: the tail of each head's K and V in VIEW, where the scales
    belong. (K and V are dim 1 up to vLLM 0.25, halves of the last dim after.)"""
    pad = torch.float32.itemsize // view.element_size()
    if view.dim() == 5:
        halves = view.unbind(1)
    else:
        halves = view.split(view.shape[-1] // 2, dim=-1)
    raw.zero_()
    for half in halves:
        mark_bytes(half[..., -pad:])
    mask = raw != 0
    raw.zero_()
    return mask


def scale_bytes_of(
    raw: torch.Tensor, view: torch.Tensor, cache_dtype: str, sliding_window: int | None
) -> torch.Tensor:
    """Byte mask of RAW under the scale views Triton carves out of VIEW: one float32
    per (block, K/V, slot, head), all in the padding of VIEW's heads."""
    padding = padding_of(raw, view)
    impl = TritonAttentionImpl(
        num_heads=NUM_QUERY_HEADS,
        head_size=HEAD_SIZE,
        scale=HEAD_SIZE**-0.5,
        num_kv_heads=NUM_KV_HEADS,
        alibi_slopes=None,
        sliding_window=sliding_window,
        kv_cache_dtype=cache_dtype,
    )
    impl._ensure_scale_caches(view)
    mark_bytes(impl._k_scale_cache)
    mark_bytes(impl._v_scale_cache)
    scales = raw != 0
    raw.zero_()
    assert int(scales.sum()) == 2 * view.shape[0] * BLOCK_SIZE * NUM_KV_HEADS * 4
    assert not (scales & ~padding).any(), "scales outside the layer's padding"
    return scales


@pytest.mark.parametrize("cache_dtype", PER_TOKEN_HEAD_DTYPES)
def test_per_token_head_scales_stay_in_their_packed_layer(cache_dtype):
    specs = gpt_oss_like_specs(cache_dtype)
    raw, views = packed_views(specs, cache_dtype)
    claimed = torch.zeros_like(raw, dtype=torch.bool)
    for layer, (spec, view) in enumerate(zip(specs, views)):
        window = getattr(spec, "sliding_window", None)
        scales = scale_bytes_of(raw, view, cache_dtype, window)
        # No two layers share a scale byte.
        assert not (scales & claimed).any(), f"layer {layer}: scales shared"
        claimed |= scales
