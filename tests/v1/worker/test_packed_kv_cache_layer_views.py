# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Packed (cross-layer) KV pages: each layer's view walks its own page (vllm#47054).

A packed block row holds one page per layer. Every layer's cache view must address
exactly its page, in the physical order its layout declares, one block row apart.
The check is written once and driven through whichever KV cache layout API this
vLLM has, so that the same cases run on every release:

- the per-backend API (up to 0.26): ``_reshape_attention_kv_cache`` with
  FlashAttention's cache shape and HND stride order, the layout the
  OffloadingConnector selects for cross-layer blocks;
- the ``KVCacheLayout`` API (after the layout rewrite, RFC #42082):
  ``create_kv_cache_views`` with ``BLHNC``, the block-outermost heads-first layout
  in which every block row holds all layers' pages.
"""

from dataclasses import dataclass

import pytest
import torch

from vllm.v1 import kv_cache_interface
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

# No distributed state or engine here: vLLM's per-test global cleanup (~0.7 s a case
# on CPU) is skipped, as its conftest allows for such unit tests.
pytestmark = [pytest.mark.cpu_test, pytest.mark.skip_global_cleanup]

NUM_BLOCKS = 5
HEAD_SIZE = 64
NUM_LAYERS = 3
# Only the KVCacheLayout API has create_kv_cache_views.
HAS_LAYOUT_API = hasattr(kv_cache_interface, "create_kv_cache_views")
# For test modules written for that API alone.
LAYOUT_API_ONLY = pytest.mark.skipif(
    not HAS_LAYOUT_API,
    reason="the KVCacheLayout API (create_kv_cache_views) is newer than this vLLM",
)


@dataclass
class PackedViews:
    raw: torch.Tensor  # the int8 region the views' pages lie in
    views: list[torch.Tensor]  # one per layer, as the attention kernels get them
    stride_order: tuple[int, ...]  # physical order of the views' logical dims
    page_bytes: int
    block_stride: int
    # Bytes from one layer's page to the next; 0: page_bytes (pages back to back).
    layer_stride: int = 0

    @property
    def page_step(self) -> int:
        return self.layer_stride or self.page_bytes


def physical_strides(shape, stride_order, block_stride_elems) -> tuple[int, ...]:
    """Element strides of a page stored in ``stride_order``, rows ``block_stride``
    apart."""
    physical_shape = [shape[i] for i in stride_order]
    strides = [0] * len(shape)
    step = 1
    for pos in reversed(range(1, len(shape))):
        strides[stride_order[pos]] = step
        step *= physical_shape[pos]
    strides[stride_order[0]] = block_stride_elems
    return tuple(strides)


def probe_indices(shape, seed: int = 0) -> list[tuple[int, ...]]:
    """The first and last element of the view and a few seeded random ones."""
    generator = torch.Generator().manual_seed(seed)
    indices = [tuple(0 for _ in shape), tuple(n - 1 for n in shape)]
    for _ in range(4):
        indices.append(
            tuple(int(torch.randint(n, (1,), generator=generator)) for n in shape)
        )
    return indices


def key_value_views(
    cache: torch.Tensor, head_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of an attention cache view, each [blocks, block_size, heads, head_size].

    The backends' logical shape changed in vLLM 0.26: [blocks, 2, block_size, heads,
    head_size] before, K and V side by side in the last dim after ([blocks, heads,
    block_size, 2 * head_size]). Both are views; writes go to the cache.
    """
    if cache.dim() == 5:
        key, value = cache.unbind(1)
    else:
        key, value = cache.transpose(1, 2).split(head_size, dim=-1)
    return key, value


def logical_from_pages(pages: torch.Tensor, shape, stride_order) -> torch.Tensor:
    """PAGES ([blocks, elements of one page]) read the way the backend declares them
    stored: dims in STRIDE_ORDER, turned back into the logical SHAPE."""
    physical = pages.reshape(pages.shape[0], *(shape[i] for i in stride_order[1:]))
    return physical.permute(*(list(stride_order).index(i) for i in range(len(shape))))


def check_packed_layer_views(packed: PackedViews, shape, dtype: torch.dtype) -> None:
    """Every view has SHAPE, walks its page in physical order, aliases the packed
    allocation at its layer's offset, and filling the pages writes nothing else."""
    raw, stride_order = packed.raw, packed.stride_order
    dtype_size = torch.empty((), dtype=dtype).element_size()
    physical_shape = [shape[i] for i in stride_order]
    num_blocks = shape[0]
    for layer, view in enumerate(packed.views):
        offset = layer * packed.page_step
        assert tuple(view.shape) == tuple(shape), f"layer {layer}: shape"
        assert view.dtype == dtype
        # (The stride of a dimension of size 1 is never used; torch reports any.)
        expected = physical_strides(
            shape, stride_order, packed.block_stride // dtype_size
        )
        assert [s for s, n in zip(view.stride(), shape) if n > 1] == [
            s for s, n in zip(expected, shape) if n > 1
        ], f"layer {layer}: strides {view.stride()}, expected {expected}"
        # A view of the packed allocation at the layer's offset, not a copy. (RAW may
        # itself start inside a larger allocation, at the tensor's byte offset.)
        assert view.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr()
        assert view.storage_offset() * dtype_size == raw.storage_offset() + offset

        # A value written at a logical index lands at the byte that the packing
        # plan and the physical layout predict.
        marker = torch.tensor([layer + 1.5]).to(dtype)
        for index in probe_indices(shape, seed=layer):
            physical_index = [index[i] for i in stride_order]
            within_page = 0
            for pos in range(1, len(shape)):
                within_page = within_page * physical_shape[pos] + physical_index[pos]
            byte = index[0] * packed.block_stride + offset + within_page * dtype_size
            view[index] = marker[0]
            landed = raw[byte : byte + dtype_size]
            assert landed.tolist() == marker.view(torch.int8).tolist(), (
                f"layer {layer}: write at {index} did not land at byte {byte}"
            )
            view[index] = 0

    # Each view fills exactly its layer's page of every block: no overlap, and
    # nothing between or after the pages changes.
    before = raw.clone()
    for layer, view in enumerate(packed.views):
        view.view(torch.int8).fill_(layer + 1)
    outside = torch.ones(raw.numel(), dtype=torch.bool)
    within = torch.arange(packed.page_bytes)
    for layer in range(len(packed.views)):
        starts = (
            torch.arange(num_blocks) * packed.block_stride + layer * packed.page_step
        )
        page = (starts[:, None] + within).flatten()
        assert bool((raw[page] == layer + 1).all()), (
            f"layer {layer} page was overwritten"
        )
        outside[page] = False
    assert torch.equal(raw[outside], before[outside]), "bytes outside the pages changed"


def gpt_oss_like_specs(num_kv_heads, block_size, dtype):
    """Sliding-window and full attention layers alternating, as in GPT-OSS."""
    common = dict(
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_size=HEAD_SIZE,
        dtype=dtype,
    )
    return [
        SlidingWindowSpec(sliding_window=128, **common)
        if layer % 2 == 0
        else FullAttentionSpec(**common)
        for layer in range(NUM_LAYERS)
    ]


def views_per_backend_api(specs, num_blocks) -> PackedViews:
    """FlashAttention's HND views of packed pages (_reshape_attention_kv_cache)."""
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.utils import (
        get_kv_cache_layout,
        set_kv_cache_layout,
    )
    from vllm.v1.worker.gpu.attn_utils import _reshape_attention_kv_cache

    spec = specs[0]
    set_kv_cache_layout("HND")  # what the OffloadingConnector requires
    get_kv_cache_layout.cache_clear()
    try:
        shape = FlashAttentionBackend.get_kv_cache_shape(
            num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size
        )
        order = tuple(FlashAttentionBackend.get_kv_cache_stride_order())
    finally:
        set_kv_cache_layout(None)
        get_kv_cache_layout.cache_clear()
    page_bytes = spec.page_size_bytes
    block_stride = len(specs) * page_bytes
    raw = torch.zeros(num_blocks * block_stride, dtype=torch.int8)
    views = [
        _reshape_attention_kv_cache(
            raw, s, shape, order, num_blocks, (layer * page_bytes, block_stride)
        )
        for layer, s in enumerate(specs)
    ]
    return PackedViews(raw, views, order, page_bytes, block_stride)


def views_layout_api(specs, num_blocks) -> PackedViews:
    """BLHNC views: every block row holds all layers' pages, heads before tokens."""
    from vllm.v1.kv_cache_interface import (
        KVCacheLayout,
        KVCacheTensor,
        create_kv_cache_views,
    )

    layout = KVCacheLayout.BLHNC
    page_bytes = specs[0].page_size_bytes
    block_stride = len(specs) * page_bytes
    tensor = KVCacheTensor(
        size=num_blocks * block_stride,
        layers=[f"model.layers.{i}.self_attn.attn" for i in range(len(specs))],
        layer_stride=page_bytes,
        block_stride=block_stride,
    )
    raw = torch.zeros(tensor.size, dtype=torch.int8)
    views = create_kv_cache_views(raw, specs[0], num_blocks, layout, tensor)
    return PackedViews(raw, views, layout.layer_view_order, page_bytes, block_stride)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
# Heads != block size: with equal sizes a swapped view is indistinguishable.
@pytest.mark.parametrize(("num_kv_heads", "block_size"), [(4, 16), (8, 32)])
def test_packed_layer_views_walk_their_pages(dtype, num_kv_heads, block_size):
    specs = gpt_oss_like_specs(num_kv_heads, block_size, dtype)
    build = views_layout_api if HAS_LAYOUT_API else views_per_backend_api
    packed = build(specs, NUM_BLOCKS)
    # The logical shape each API promises its kernels.
    if HAS_LAYOUT_API:  # [blocks, heads, tokens, K and V side by side]
        shape = (NUM_BLOCKS, num_kv_heads, block_size, 2 * HEAD_SIZE)
    else:
        from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

        shape = FlashAttentionBackend.get_kv_cache_shape(
            NUM_BLOCKS, block_size, num_kv_heads, HEAD_SIZE
        )
    check_packed_layer_views(packed, shape, dtype)
