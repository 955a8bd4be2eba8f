# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Paged attention over packed (cross-layer) KV cache views, in plain torch.

A reference cache write and paged attention that follow the kernels' contract:
they take ``block_size`` and ``num_kv_heads`` from the cache view's shape
``[num_blocks, 2, block_size, num_kv_heads, head_size]`` and address tokens
through a block table. Over the views of a packed block row (vllm#47054), the
result must equal dense attention over the same K/V, for every layer.
"""

import pytest
import torch

import tests.v1.worker.per_backend_kv_layout  # noqa: F401 (skips without that API)
from tests.v1.worker.per_backend_kv_layout import FlashInferBackend, flashinfer_param
from tests.v1.worker.test_packed_kv_cache_layer_views import key_value_views
from tests.v1.worker.test_packed_kv_cache_reshape import kv_cache_layout
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.attention.backends.flex_attention import FlexAttentionBackend
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from vllm.v1.worker.gpu.attn_utils import _reshape_attention_kv_cache

# No distributed state or engine here: vLLM's per-test global cleanup (~0.7 s a case
# on CPU) is skipped, as its conftest allows for such unit tests.
pytestmark = [pytest.mark.cpu_test, pytest.mark.skip_global_cleanup]

NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE = 12, 16, 4, 32
NUM_QUERY_HEADS = 8
SEQ_LENS = [29, 16, 7]


@pytest.fixture(autouse=True)
def hnd_layout():
    """The layout the OffloadingConnector requires."""
    with kv_cache_layout("HND"):
        yield


def write_kv(cache, key, value, slot_mapping):
    """reshape_and_cache: token i goes to slot block * block_size + offset."""
    key_cache, value_cache = key_value_views(cache, HEAD_SIZE)
    block_size = key_cache.shape[1]
    for token, slot in enumerate(slot_mapping.tolist()):
        block, offset = divmod(slot, block_size)
        key_cache[block, offset] = key[token]
        value_cache[block, offset] = value[token]


def paged_attention(cache, query, block_table, seq_len):
    """Causal attention of SEQ_LEN query tokens over the cache, via the block table.
    Block size and head count come from the view, as the kernels take them."""
    key_cache, value_cache = key_value_views(cache, HEAD_SIZE)
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    positions = torch.arange(seq_len)
    blocks = block_table[positions // block_size]
    key = key_cache[blocks, positions % block_size]
    value = value_cache[blocks, positions % block_size]
    group = query.shape[1] // num_kv_heads
    return dense_attention(query, key, value, group)


def dense_attention(query, key, value, group):
    key = key.float().repeat_interleave(group, dim=1)
    value = value.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.float(), key) * HEAD_SIZE**-0.5
    causal = torch.ones(query.shape[0], key.shape[0], dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, -torch.inf)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), value)


@pytest.mark.parametrize(
    "backend",
    [
        FlashAttentionBackend,
        TritonAttentionBackend,
        FlexAttentionBackend,
        flashinfer_param(FlashInferBackend, id="FlashInferBackend"),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_over_packed_views(backend, dtype):
    common = dict(
        block_size=BLOCK_SIZE,
        num_kv_heads=NUM_KV_HEADS,
        head_size=HEAD_SIZE,
        dtype=dtype,
    )
    specs = [
        SlidingWindowSpec(sliding_window=128, **common),
        FullAttentionSpec(**common),
    ]
    page_bytes = specs[0].page_size_bytes
    block_stride = len(specs) * page_bytes
    raw = torch.zeros(NUM_BLOCKS * block_stride, dtype=torch.int8)
    shape = backend.get_kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    order = backend.get_kv_cache_stride_order()
    caches = [
        _reshape_attention_kv_cache(
            raw, spec, shape, order, NUM_BLOCKS, (layer * page_bytes, block_stride)
        )
        for layer, spec in enumerate(specs)
    ]

    # Scattered, non-contiguous blocks per sequence, as the block pool hands out.
    gen = torch.Generator().manual_seed(0)
    free = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    tables = []
    for seq_len in SEQ_LENS:
        needed = -(-seq_len // BLOCK_SIZE)
        tables.append(torch.tensor([free.pop() for _ in range(needed)]))

    def rand(*size):
        return torch.randn(*size, generator=gen).to(dtype)

    data = []
    for cache in caches:
        per_layer = []
        for table, seq_len in zip(tables, SEQ_LENS):
            key = rand(seq_len, NUM_KV_HEADS, HEAD_SIZE)
            value = rand(seq_len, NUM_KV_HEADS, HEAD_SIZE)
            query = rand(seq_len, NUM_QUERY_HEADS, HEAD_SIZE)
            positions = torch.arange(seq_len)
            slots = table[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
            write_kv(cache, key, value, slots)
            per_layer.append((key, value, query))
        data.append(per_layer)

    # Read back only after every layer has written: neighbours must not clobber.
    group = NUM_QUERY_HEADS // NUM_KV_HEADS
    for layer, cache in enumerate(caches):
        for seq, (table, seq_len) in enumerate(zip(tables, SEQ_LENS)):
            key, value, query = data[layer][seq]
            got = paged_attention(cache, query, table, seq_len)
            want = dense_attention(query, key, value, group)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
