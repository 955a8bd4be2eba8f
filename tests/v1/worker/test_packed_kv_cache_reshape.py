# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Packed (cross-layer) KV cache pages must be viewed in their physical order.

Regression tests for https://github.com/vllm-project/vllm/issues/47054: with
``enable_cross_layers_blocks`` the planner packs the pages of several layers
(e.g. GPT-OSS sliding-window and full-attention layers) into one block row,
and ``_reshape_attention_kv_cache`` gets ``packing=(offset, block_stride)``.
The OffloadingConnector selects the HND layout, whose stride order is not the
identity, and the view handed to the attention backend must then still have
the backend's logical shape, with strides that walk the page in physical order.

Every case here uses a non-identity stride order and ``num_kv_heads !=
block_size``, so every case fails on a tree without the fix. (Under HND,
FlashAttention's, Triton's and the diff-KV backends' orders swap exactly the
slot and head dimensions: when those sizes are equal the unfixed view
coincides with the fixed one.)
"""

import contextlib
from math import prod

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tests.v1.worker.per_backend_kv_layout  # noqa: F401 (skips without that API)
from tests.v1.worker.per_backend_kv_layout import (
    FLASHINFER_MISSING,
    FlashInferBackend,
    flashinfer_param,
)
from tests.v1.worker.test_packed_kv_cache_layer_views import (
    PackedViews,
    check_packed_layer_views,
)
from vllm.utils.torch_utils import get_dtype_size
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.attention.backends.flash_attn_diffkv import FlashAttentionDiffKVBackend
from vllm.v1.attention.backends.flex_attention import FlexAttentionBackend
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
from vllm.v1.attention.backends.triton_attn_diffkv import TritonAttentionDiffKVBackend
from vllm.v1.attention.backends.utils import get_kv_cache_layout, set_kv_cache_layout
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from vllm.v1.worker.gpu.attn_utils import _reshape_attention_kv_cache

# No distributed state or engine here: vLLM's per-test global cleanup (~0.7 s a case
# on CPU) is skipped, as its conftest allows for such unit tests.
pytestmark = [pytest.mark.cpu_test, pytest.mark.skip_global_cleanup]

NUM_BLOCKS = 5
HEAD_SIZE = 64
BACKENDS = [
    FlashAttentionBackend,
    TritonAttentionBackend,
    FlexAttentionBackend,
    FlashAttentionDiffKVBackend,
    TritonAttentionDiffKVBackend,
]
if FlashInferBackend is not None:
    BACKENDS.append(FlashInferBackend)
DIFF_KV_BACKENDS = (FlashAttentionDiffKVBackend, TritonAttentionDiffKVBackend)


@contextlib.contextmanager
def kv_cache_layout(layout: str):
    """Select a KV cache layout the way a connector does, and restore it afterwards."""
    set_kv_cache_layout(layout)
    get_kv_cache_layout.cache_clear()
    try:
        yield
    finally:
        set_kv_cache_layout(None)
        get_kv_cache_layout.cache_clear()


def stride_order_of(backend, layout: str) -> tuple[int, ...]:
    with kv_cache_layout(layout):
        return tuple(backend.get_kv_cache_stride_order())


def _is_identity(order: tuple[int, ...]) -> bool:
    return order == tuple(range(len(order)))


# Asked of the backend classes rather than written down, so that a backend whose
# order changes is picked up (or dropped) by itself.
ALL_CASES = [(backend, layout) for backend in BACKENDS for layout in ("NHD", "HND")]
PERMUTED_CASES = [
    pytest.param(backend, layout, id=f"{backend.get_name()}-{layout}")
    for backend, layout in ALL_CASES
    if not _is_identity(stride_order_of(backend, layout))
]
if FLASHINFER_MISSING:  # its HND order, measured where it imports: (0, 1, 3, 2, 4)
    PERMUTED_CASES.append(flashinfer_param(None, "HND", id="FLASHINFER-HND"))


def layer_specs(backend, block_size, num_kv_heads, head_size, dtype, num_layers):
    """GPT-OSS-like layers, alternating sliding-window and full attention."""
    extra = {}
    if backend in DIFF_KV_BACKENDS:
        extra["head_size_v"] = backend.head_size_v
    common = dict(
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=dtype,
        **extra,
    )
    return [
        SlidingWindowSpec(sliding_window=128, **common)
        if layer % 2 == 0
        else FullAttentionSpec(**common)
        for layer in range(num_layers)
    ]


def check_packed_views(backend, stride_order, specs, cache_dtype, num_blocks):
    """Pack SPECS side by side in one block row, reshape each, and check every view."""
    spec0 = specs[0]
    shape = backend.get_kv_cache_shape(
        num_blocks, spec0.block_size, spec0.num_kv_heads, spec0.head_size, cache_dtype
    )
    page_bytes = prod(shape[1:]) * get_dtype_size(spec0.dtype)
    # The planner sizes pages from the specs; the view from the backend's shape.
    assert all(spec.page_size_bytes == page_bytes for spec in specs)
    block_stride = page_bytes * len(specs)
    raw = torch.zeros(num_blocks * block_stride, dtype=torch.int8)
    views = [
        _reshape_attention_kv_cache(
            raw,
            spec,
            shape,
            stride_order,
            num_blocks,
            (layer * page_bytes, block_stride),
        )
        for layer, spec in enumerate(specs)
    ]
    packed = PackedViews(raw, views, stride_order, page_bytes, block_stride)
    check_packed_layer_views(packed, shape, spec0.dtype)


@pytest.mark.parametrize(("backend", "layout"), PERMUTED_CASES)
@pytest.mark.parametrize(
    ("dtype", "cache_dtype"),
    [(torch.bfloat16, "auto"), (torch.float8_e4m3fn, "fp8")],
    ids=["bf16", "fp8"],
)
@pytest.mark.parametrize(
    ("num_kv_heads", "block_size"), [(4, 16), (8, 32)], ids=["4h-16", "8h-32"]
)
def test_packed_layers_view_physical_layout(
    backend, layout, dtype, cache_dtype, num_kv_heads, block_size
):
    stride_order = stride_order_of(backend, layout)
    # Three GPT-OSS-like layers at offsets of 0, 1 and 2 pages in each block row.
    specs = layer_specs(backend, block_size, num_kv_heads, HEAD_SIZE, dtype, 3)
    with kv_cache_layout(layout):
        check_packed_views(backend, stride_order, specs, cache_dtype, NUM_BLOCKS)


DTYPES = {
    torch.bfloat16: "auto",
    torch.float16: "auto",
    torch.float32: "auto",
    torch.float8_e4m3fn: "fp8",
}


@settings(max_examples=60, deadline=None)
@given(
    case=st.sampled_from(ALL_CASES),
    block_size=st.sampled_from([16, 32, 48, 64]),
    num_kv_heads=st.integers(min_value=1, max_value=8),
    head_size=st.sampled_from([8, 32, 64, 80]),
    num_layers=st.integers(min_value=1, max_value=4),
    num_blocks=st.integers(min_value=1, max_value=4),
    dtype=st.sampled_from(list(DTYPES)),
)
def test_packed_views_alias_their_pages(
    case, block_size, num_kv_heads, head_size, num_layers, num_blocks, dtype
):
    """For any backend, layout and size: the packed views have the logical shape,
    the physical order, and alias exactly their own bytes of the block row."""
    backend, layout = case
    stride_order = stride_order_of(backend, layout)
    specs = layer_specs(backend, block_size, num_kv_heads, head_size, dtype, num_layers)
    with kv_cache_layout(layout):
        check_packed_views(backend, stride_order, specs, DTYPES[dtype], num_blocks)
