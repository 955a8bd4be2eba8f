# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Packed KV pages under every block-row layout of the KVCacheLayout API.

``create_kv_cache_views`` places layer ``l``'s page of block ``b`` at the tensor's byte
offset plus ``l * layer_stride + b * block_stride``, and orders each page's heads,
tokens and content as the layout says. Each layout whose block rows hold whole pages
(block outermost, then layer: ``BLHNC`` and ``BLNHC``) is checked on a tensor that
starts inside a larger allocation, with pages back to back and with space between
them: each layer's view has the logical shape, walks its own page in the layout's
physical order, aliases the allocation at its offset, and nothing outside the pages
is written. (The per-backend API before the layout rewrite has no such layouts;
there this module skips.)
"""

import pytest
import torch

from tests.v1.worker.test_packed_kv_cache_layer_views import (
    HEAD_SIZE,
    LAYOUT_API_ONLY,
    NUM_BLOCKS,
    PackedViews,
    check_packed_layer_views,
    gpt_oss_like_specs,
)

pytestmark = [
    pytest.mark.cpu_test,
    pytest.mark.skip_global_cleanup,
    LAYOUT_API_ONLY,
]

# Bytes of other tensors before the packed one in the same allocation.
TENSOR_OFFSET = 3 * 1024
# Spacing of the pages in a block row (bytes after each page, after each row): back to
# back, as the planner packs same-size pages, or spaced, as a row that also holds
# other groups' larger pages is (the views must follow the tensor's strides, not
# recompute them from the page size).
SPACINGS = {"dense": (0, 0), "spaced": (256, 1024)}


def block_row_layouts() -> list[str]:
    """The layouts whose block rows hold each layer's whole page (B, then L, first)."""
    try:
        from vllm.v1.kv_cache_layout import KVCacheLayout
    except ImportError:
        return ["BLHNC", "BLNHC"]  # the names, for collection on older vLLM
    return [
        layout.name
        for layout in KVCacheLayout
        if layout.is_block_outermost and layout.is_block_compact
    ]


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"]
)
@pytest.mark.parametrize("spacing", list(SPACINGS))
@pytest.mark.parametrize("layout_name", block_row_layouts())
def test_packed_views_at_an_offset_follow_the_layout(layout_name, spacing, dtype):
    from vllm.v1.kv_cache_interface import KVCacheTensor, create_kv_cache_views
    from vllm.v1.kv_cache_layout import KVCacheLayout

    layout = KVCacheLayout[layout_name]
    num_kv_heads, block_size = 4, 16  # unequal: a swapped H and N would show
    specs = gpt_oss_like_specs(num_kv_heads, block_size, dtype)
    page_bytes = specs[0].page_size_bytes
    after_page, after_row = SPACINGS[spacing]
    layer_stride = page_bytes + after_page
    block_stride = len(specs) * layer_stride + after_row
    tensor = KVCacheTensor(
        size=NUM_BLOCKS * block_stride,
        layers=[f"model.layers.{i}.self_attn.attn" for i in range(len(specs))],
        layer_stride=layer_stride,
        block_stride=block_stride,
        offset=TENSOR_OFFSET,
    )
    allocation = torch.zeros(TENSOR_OFFSET + tensor.size + 64, dtype=torch.int8)
    views = create_kv_cache_views(allocation, specs[0], NUM_BLOCKS, layout, tensor)
    packed = PackedViews(
        allocation[TENSOR_OFFSET : TENSOR_OFFSET + tensor.size],
        views,
        layout.layer_view_order,
        page_bytes,
        block_stride,
        layer_stride,
    )
    shape = (NUM_BLOCKS, num_kv_heads, block_size, 2 * HEAD_SIZE)
    check_packed_layer_views(packed, shape, dtype)
    # The check filled every page; the bytes around the tensor are untouched.
    assert not allocation[:TENSOR_OFFSET].any()
    assert not allocation[TENSOR_OFFSET + tensor.size :].any()
