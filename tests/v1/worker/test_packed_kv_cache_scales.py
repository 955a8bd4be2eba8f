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

The same views go wrong on a padded page, with no connector at all (vllm#49716): in
a Gemma-4-style hybrid (sliding-window layers with many narrow KV heads, full
attention layers with few wide ones) the inline scales break the 2:1 ratio of the
two page sizes, so vLLM pads the smaller page to the larger one and reads it through
a strided view whose blocks are a padded page apart. 0.24-0.25 stepped one unpadded
page per block, and every block's scales but the first fell outside its page's
heads. (0.26 reads the block stride from the view, #44455.)

Driven through whichever KV cache layout API this vLLM has, as in
test_packed_kv_cache_layer_views.py: ``_reshape_attention_kv_cache`` with Triton's
padded HND shape up to 0.26, ``create_kv_cache_views`` with ``BLHNC`` after the
layout rewrite (RFC #42082).
"""

import contextlib
from dataclasses import replace
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


@contextlib.contextmanager
def kv_cache_layout(layout: str):
    """Up to 0.26 the layout is a cached process-wide value: set it for the case (the
    layout API takes it per view instead)."""
    if HAS_LAYOUT_API:
        yield
        return
    from vllm.v1.attention.backends.utils import (
        get_kv_cache_layout,
        set_kv_cache_layout,
    )

    set_kv_cache_layout(layout)
    get_kv_cache_layout.cache_clear()
    try:
        yield
    finally:
        set_kv_cache_layout(None)
        get_kv_cache_layout.cache_clear()


def blhnc_views(
    raw: torch.Tensor, spec, names: list[str], layer_stride: int, block_stride: int
) -> list[torch.Tensor]:
    """The layers' views of RAW through the KVCacheLayout API (0.33), under BLHNC."""
    from vllm.v1.kv_cache_interface import (
        KVCacheLayout,
        KVCacheTensor,
        create_kv_cache_views,
    )

    tensor = KVCacheTensor(
        size=raw.numel(),
        layers=names,
        layer_stride=layer_stride,
        block_stride=block_stride,
    )
    return create_kv_cache_views(raw, spec, NUM_BLOCKS, KVCacheLayout.BLHNC, tensor)


def packed_views(specs, cache_dtype: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One int8 allocation of NUM_BLOCKS rows, each holding every layer's page, and
    the per-layer views the attention layers get."""
    page_bytes = specs[0].page_size_bytes
    block_stride = len(specs) * page_bytes
    raw = torch.zeros(NUM_BLOCKS * block_stride, dtype=torch.int8)
    if HAS_LAYOUT_API:
        names = [f"model.layers.{i}.self_attn.attn" for i in range(len(specs))]
        return raw, blhnc_views(raw, specs[0], names, page_bytes, block_stride)

    from vllm.v1.worker.gpu.attn_utils import _reshape_attention_kv_cache

    with kv_cache_layout("HND"):  # what the OffloadingConnector requires
        shape = TritonAttentionBackend.get_kv_cache_shape(
            NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, cache_dtype_str=cache_dtype
        )
        order = TritonAttentionBackend.get_kv_cache_stride_order()
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
    raw: torch.Tensor,
    view: torch.Tensor,
    cache_dtype: str,
    sliding_window: int | None,
    num_kv_heads: int = NUM_KV_HEADS,
    head_size: int = HEAD_SIZE,
) -> torch.Tensor:
    """Byte mask of RAW under the scale views Triton carves out of VIEW: one float32
    per (block, K/V, slot, head), all in the padding of VIEW's heads."""
    padding = padding_of(raw, view)
    impl = TritonAttentionImpl(
        num_heads=NUM_QUERY_HEADS,
        head_size=head_size,
        scale=head_size**-0.5,
        num_kv_heads=num_kv_heads,
        alibi_slopes=None,
        sliding_window=sliding_window,
        kv_cache_dtype=cache_dtype,
    )
    impl._ensure_scale_caches(view)
    mark_bytes(impl._k_scale_cache)
    mark_bytes(impl._v_scale_cache)
    scales = raw != 0
    raw.zero_()
    assert int(scales.sum()) == 2 * view.shape[0] * BLOCK_SIZE * num_kv_heads * 4
    outside = int((scales & ~padding).sum())
    assert not outside, f"{outside} scale bytes outside the layer's padding"
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


# Gemma 4's two attention shapes, scaled down: sliding-window layers with many narrow
# KV heads, full attention layers with a quarter of the heads at twice the size (one
# full page is half a sliding one, until the inline scales are added).
GEMMA4_LIKE_LAYERS = {
    "model.layers.0.self_attn.attn": dict(num_kv_heads=4, head_size=64, window=128),
    "model.layers.1.self_attn.attn": dict(num_kv_heads=1, head_size=128, window=None),
}


def gemma4_like_specs(cache_dtype: str) -> dict:
    """The layers' specs as the runner has them before planning (with the backend's
    ``indexes_kv_by_block_stride``, or the scales' padding on the layout API), their
    page sizes unified by vLLM's planner: the full attention page is padded."""
    try:
        from vllm.v1.core.kv_cache_planning import unify_kv_cache_spec_page_size
    except ImportError:  # up to 0.26
        from vllm.v1.core.kv_cache_utils import unify_kv_cache_spec_page_size
    specs = {}
    for name, layer in GEMMA4_LIKE_LAYERS.items():
        common = dict(
            block_size=BLOCK_SIZE,
            num_kv_heads=layer["num_kv_heads"],
            head_size=layer["head_size"],
            dtype=kv_cache_dtype_str_to_dtype(cache_dtype, None),
            kv_quant_mode=get_kv_quant_mode(cache_dtype),
        )
        if layer["window"] is None:
            spec = FullAttentionSpec(**common)
        else:
            spec = SlidingWindowSpec(sliding_window=layer["window"], **common)
        if HAS_LAYOUT_API:
            spec = TritonAttentionBackend.customize_spec(spec)
        else:
            indexes = TritonAttentionBackend.indexes_kv_by_block_stride()
            spec = replace(spec, indexes_kv_by_block_stride=indexes)
        specs[name] = spec
    return unify_kv_cache_spec_page_size(specs)


def padded_view(raw: torch.Tensor, name: str, spec, cache_dtype: str) -> torch.Tensor:
    """The layer's view of its own allocation of NUM_BLOCKS pages of
    ``spec.page_size_bytes`` (the page padded where the spec says so)."""
    if HAS_LAYOUT_API:
        (view,) = blhnc_views(raw, spec, [name], raw.numel(), spec.page_size_bytes)
        return view

    from vllm.v1.worker.gpu.attn_utils import _reshape_attention_kv_cache

    shape = TritonAttentionBackend.get_kv_cache_shape(
        NUM_BLOCKS,
        BLOCK_SIZE,
        spec.num_kv_heads,
        spec.head_size,
        cache_dtype_str=cache_dtype,
    )
    order = TritonAttentionBackend.get_kv_cache_stride_order()
    return _reshape_attention_kv_cache(raw, spec, shape, order, NUM_BLOCKS, None)


# NHD: the layout without a connector (the report's); HND: what the connectors that
# ask for a layout ask for.
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("cache_dtype", PER_TOKEN_HEAD_DTYPES)
def test_per_token_head_scales_stay_in_their_padded_pages(cache_dtype, layout):
    with kv_cache_layout(layout):
        specs = gemma4_like_specs(cache_dtype)
        page_sizes = {spec.page_size_bytes for spec in specs.values()}
        assert len(page_sizes) == 1
        padded = [n for n, s in specs.items() if s.page_size_padded is not None]
        assert padded == ["model.layers.1.self_attn.attn"], "no page was padded"
        raw = torch.zeros(NUM_BLOCKS * page_sizes.pop(), dtype=torch.int8)
        for name, spec in specs.items():
            view = padded_view(raw, name, spec, cache_dtype)
            scale_bytes_of(
                raw,
                view,
                cache_dtype,
                getattr(spec, "sliding_window", None),
                num_kv_heads=spec.num_kv_heads,
                head_size=spec.head_size,
            )
