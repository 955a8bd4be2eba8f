# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Packed (cross-layer) KV cache pages must be viewed in their physical order.

Regression test for https://github.com/vllm-project/vllm/issues/47054: with
``enable_cross_layers_blocks`` the planner packs the pages of several layers
(e.g. GPT-OSS sliding-window and full-attention layers) into one block row,
and ``_reshape_attention_kv_cache`` gets ``packing=(offset, block_stride)``.
The OffloadingConnector selects the HND layout, whose stride order is not the
identity, and the view handed to FlashAttention must then still have the
backend's logical shape, with strides that walk the page in physical order.
Every case here uses a non-identity stride order, so every case fails on a
tree without the fix.
"""

from math import prod

import pytest
import torch

from vllm.utils.torch_utils import get_dtype_size
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.attention.backends.flex_attention import FlexAttentionBackend
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
from vllm.v1.attention.backends.utils import get_kv_cache_layout, set_kv_cache_layout
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from vllm.v1.worker.gpu.attn_utils import _reshape_attention_kv_cache

pytestmark = pytest.mark.cpu_test

NUM_BLOCKS = 5
HEAD_SIZE = 64


@pytest.fixture
def kv_cache_layout(request):
    """Select a KV cache layout the way a connector does, and restore it afterwards."""
    set_kv_cache_layout(request.param)
    get_kv_cache_layout.cache_clear()
    yield request.param
    set_kv_cache_layout(None)
    get_kv_cache_layout.cache_clear()


def _physical_strides(shape, stride_order, block_stride_elems):
    """Element strides of a page laid out in ``stride_order``, rows ``block_stride`` apart."""
    physical_shape = [shape[i] for i in stride_order]
    strides = [0] * len(shape)
    step = 1
    for pos in reversed(range(1, len(shape))):
        strides[stride_order[pos]] = step
        step *= physical_shape[pos]
    strides[stride_order[0]] = block_stride_elems
    return tuple(strides)


@pytest.mark.parametrize(
    ("backend", "kv_cache_layout"),
    [
        (FlashAttentionBackend, "HND"),
        (TritonAttentionBackend, "HND"),
        (FlexAttentionBackend, "NHD"),
        (FlexAttentionBackend, "HND"),
    ],
    indirect=["kv_cache_layout"],
)
@pytest.mark.parametrize(
    ("dtype", "cache_dtype"),
    [(torch.bfloat16, "auto"), (torch.float8_e4m3fn, "fp8")],
)
# num_kv_heads != block_size on purpose: under HND, FlashAttention's and Triton's
# orders swap the slot and head dims, so with equal sizes the unfixed view would
# coincide with the fixed one and the case could not fail without the fix.
@pytest.mark.parametrize(("num_kv_heads", "block_size"), [(4, 16), (8, 32)])
def test_packed_layers_view_physical_layout(
    backend, kv_cache_layout, dtype, cache_dtype, num_kv_heads, block_size
):
    stride_order = backend.get_kv_cache_stride_order()
    assert stride_order != tuple(range(len(stride_order))), "case needs a permuted layout"

    # A GPT-OSS-like block row: sliding-window and full-attention layers, packed
    # side by side at offsets 0, 1 and 2 pages.
    sliding = SlidingWindowSpec(
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_size=HEAD_SIZE,
        dtype=dtype,
        sliding_window=128,
    )
    full = FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_size=HEAD_SIZE,
        dtype=dtype,
    )
    specs = [sliding, full, sliding]
    shape = backend.get_kv_cache_shape(
        NUM_BLOCKS, block_size, num_kv_heads, HEAD_SIZE, cache_dtype
    )
    dtype_size = get_dtype_size(dtype)
    page_bytes = prod(shape[1:]) * dtype_size
    assert page_bytes == specs[0].page_size_bytes
    block_stride = page_bytes * len(specs)
    raw = torch.zeros(NUM_BLOCKS * block_stride, dtype=torch.int8)

    views = []
    for layer, spec in enumerate(specs):
        offset = layer * page_bytes
        view = _reshape_attention_kv_cache(
            raw, spec, shape, stride_order, NUM_BLOCKS, (offset, block_stride)
        )
        views.append(view)

        # What the attention kernels index: the backend's logical shape...
        assert view.shape == shape
        assert view.dtype == dtype
        # ...walking the page in physical (stride) order, one block row apart.
        assert view.stride() == _physical_strides(
            shape, stride_order, block_stride // dtype_size
        )
        # A view of the packed allocation, not a copy.
        assert view.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr()
        assert view.storage_offset() * dtype_size == offset

        # A value written at (block, k/v, slot, head, dim) lands at the byte the
        # packing plan and the physical layout predict.
        physical_shape = [shape[i] for i in stride_order]
        for index in [
            (0, 0, 0, 0, 0),
            (1, 1, block_size - 1, 0, 3),
            (NUM_BLOCKS - 1, 0, 2, num_kv_heads - 1, HEAD_SIZE - 1),
            (2, 1, block_size // 2, num_kv_heads // 2, 7),
        ]:
            physical_index = [index[i] for i in stride_order]
            within_page = 0
            for pos in range(1, len(shape)):
                within_page = within_page * physical_shape[pos] + physical_index[pos]
            byte = index[0] * block_stride + offset + within_page * dtype_size
            marker = torch.tensor([layer + 1.5], dtype=torch.float32).to(dtype)
            view[index] = marker[0]
            landed = raw[byte : byte + dtype_size].view(dtype)
            assert landed.view(torch.int8).tolist() == marker.view(torch.int8).tolist(), (
                f"layer {layer}: write at {index} did not land at byte {byte}"
            )
            view[index] = 0

    # The layers tile each block row exactly, without overlapping.
    for layer, view in enumerate(views):
        view.view(torch.int8).fill_(layer + 1)
    rows = raw.view(NUM_BLOCKS, block_stride)
    for layer in range(len(specs)):
        page = rows[:, layer * page_bytes : (layer + 1) * page_bytes]
        assert bool((page == layer + 1).all()), f"layer {layer} page was overwritten"
