# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM's Triton cache-write and unified-attention kernels over packed views.

TRITON_ATTN's kernels run on CPU tensors under Triton's interpreter, so this
exercises the kernels of vllm#47054 without a GPU: two layers per block row, guard
bytes around the packed allocation, a zero-padded non-contiguous block table, the
prefill (2D) and decode (2D and segmented 3D) paths, compared with a torch
reference. The packed views come from whichever KV cache layout API this vLLM has:
``_reshape_attention_kv_cache`` with TRITON_ATTN's cache shape and HND stride order
(FlashAttention's, up to 0.26), or ``create_kv_cache_views`` with ``BLHNC``, the
block-outermost layout whose block rows hold every layer's page (after the layout
rewrite, RFC #42082).

Each case runs in a fresh interpreter (this file is also the worker script):
Triton's interpreter switch and vLLM's Triton gate are read once, at import,
and a kernel that writes out of bounds may kill its process, which must count
as a failure rather than take the test session down.
"""

import sys

import pytest

from tests.v1.worker.triton_on_cpu import (
    enable_triton_on_cpu,
    run_case_in_fresh_process,
)

pytestmark = pytest.mark.cpu_test

NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE = 16, 16, 4, 64
LAYERS = 2
TOLERANCE = 5e-3  # fp16 kernels vs an fp32 reference


@pytest.mark.parametrize("num_query_heads", [8, 32])
def test_triton_kernels_on_packed_views(num_query_heads):
    run_case_in_fresh_process(
        __file__,
        str(num_query_heads),
        env={"TRITON_INTERPRET": "1", "VLLM_KV_CACHE_LAYOUT": "HND"},
    )


def views_per_backend_api(raw, spec, block_stride):
    """TRITON_ATTN's HND views of the packed pages (_reshape_attention_kv_cache)."""
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
    from vllm.v1.attention.backends.utils import get_kv_cache_layout
    from vllm.v1.worker.gpu.attn_utils import _reshape_attention_kv_cache

    assert get_kv_cache_layout() == "HND"
    shape = TritonAttentionBackend.get_kv_cache_shape(
        NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE
    )
    order = TritonAttentionBackend.get_kv_cache_stride_order()
    page_bytes = spec.page_size_bytes
    caches = [
        _reshape_attention_kv_cache(
            raw, spec, shape, order, NUM_BLOCKS, (layer * page_bytes, block_stride)
        )
        for layer in range(LAYERS)
    ]
    return caches, tuple(shape), tuple(order)


def views_layout_api(raw, spec, block_stride):
    """BLHNC views: every block row holds all layers' pages, heads before tokens."""
    from vllm.v1.kv_cache_interface import KVCacheTensor, create_kv_cache_views
    from vllm.v1.kv_cache_layout import KVCacheLayout

    layout = KVCacheLayout.BLHNC
    tensor = KVCacheTensor(
        size=raw.numel(),
        layers=[f"model.layers.{layer}.self_attn.attn" for layer in range(LAYERS)],
        layer_stride=spec.page_size_bytes,
        block_stride=block_stride,
    )
    caches = create_kv_cache_views(raw, spec, NUM_BLOCKS, layout, tensor)
    shape = (NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE)
    return caches, shape, layout.layer_view_order


def _run_case(num_query_heads: int) -> None:
    enable_triton_on_cpu()
    import torch

    from tests.v1.worker.test_packed_kv_cache_layer_views import (
        key_value_views,
        logical_from_pages,
    )
    from vllm.triton_utils import HAS_TRITON, triton
    from vllm.v1 import kv_cache_interface
    from vllm.v1.attention.ops.triton_reshape_and_cache_flash import (
        triton_reshape_and_cache_flash,
    )
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    assert HAS_TRITON, "vLLM disabled Triton"
    torch.set_num_threads(1)
    dtype = torch.float16  # the interpreter's tl.dot mishandles bf16
    scale = HEAD_SIZE**-0.5

    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE,
        num_kv_heads=NUM_KV_HEADS,
        head_size=HEAD_SIZE,
        dtype=dtype,
    )
    page_bytes = spec.page_size_bytes
    block_stride = LAYERS * page_bytes
    raw_bytes = NUM_BLOCKS * block_stride
    guard = 4 * raw_bytes  # stray stores land here instead of in someone's heap
    backing = torch.zeros(guard + raw_bytes + guard, dtype=torch.int8)
    raw = backing[guard : guard + raw_bytes]
    if hasattr(kv_cache_interface, "create_kv_cache_views"):
        caches, shape, order = views_layout_api(raw, spec, block_stride)
    else:
        caches, shape, order = views_per_backend_api(raw, spec, block_stride)
    # The kernels take block_size and num_kv_heads from these shapes: with any
    # other shape they address the wrong blocks and write past the allocation.
    for layer, cache in enumerate(caches):
        assert tuple(cache.shape) == tuple(shape), (
            f"layer {layer}: view {tuple(cache.shape)}, backend shape {shape}"
        )
    # Each block row holds LAYERS pages side by side.
    pages = raw.view(NUM_BLOCKS, LAYERS, page_bytes)

    # Two sequences over scattered blocks; rows zero-padded as the runner does.
    block_table = torch.zeros((2, 8), dtype=torch.int32)
    block_table[0, :3] = torch.tensor([3, 7, 1])
    block_table[1, :2] = torch.tensor([5, 2])
    prompt_lens = [37, 20]
    total_lens = [n + 1 for n in prompt_lens]  # plus one decode step

    gen = torch.Generator().manual_seed(0)

    def rand(*size):
        return torch.randn(*size, generator=gen).to(dtype)

    keys = [[rand(n, NUM_KV_HEADS, HEAD_SIZE) for n in total_lens] for _ in caches]
    values = [[rand(n, NUM_KV_HEADS, HEAD_SIZE) for n in total_lens] for _ in caches]
    queries = [
        [rand(n, num_query_heads, HEAD_SIZE) for n in total_lens] for _ in caches
    ]
    one = torch.tensor(1.0)

    def slot(seq, pos):
        return int(block_table[seq, pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE

    def write(layer, positions):
        """The cache-write kernel of vLLM, for POSITIONS[seq] of each sequence."""
        key = torch.cat([keys[layer][s][p] for s, p in enumerate(positions)])
        value = torch.cat([values[layer][s][p] for s, p in enumerate(positions)])
        slots = torch.tensor(
            [slot(s, p) for s, ps in enumerate(positions) for p in ps],
            dtype=torch.int64,
        )
        key_cache, value_cache = key_value_views(caches[layer], HEAD_SIZE)
        triton_reshape_and_cache_flash(
            key, value, key_cache, value_cache, slots, "auto", one, one
        )

    def check_cache(lengths):
        """Every written token, of every layer, at its physical bytes and through
        its view; so no layer overwrote its neighbour in the block row."""
        for layer in range(LAYERS):
            # The layer's page bytes, read in the order the backend declares.
            stored = key_value_views(
                logical_from_pages(pages[:, layer].view(dtype), shape, order), HEAD_SIZE
            )
            viewed = key_value_views(caches[layer], HEAD_SIZE)
            for s, n in enumerate(lengths):
                for p in range(n):
                    block, offset = divmod(slot(s, p), BLOCK_SIZE)
                    for kv, truth in enumerate((keys, values)):
                        expected = truth[layer][s][p]
                        assert torch.equal(stored[kv][block, offset], expected)
                        assert torch.equal(viewed[kv][block, offset], expected)
        assert not backing[:guard].any() and not backing[guard + raw_bytes :].any(), (
            "a kernel wrote outside the packed allocation"
        )

    def reference(q, k, v, context):
        group = num_query_heads // NUM_KV_HEADS
        k = k.float().repeat_interleave(group, dim=1)
        v = v.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
        q_pos = torch.arange(context, context + q.shape[0])[:, None]
        scores = scores.masked_fill(
            torch.arange(k.shape[0])[None, :] > q_pos, -torch.inf
        )
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)

    def attend(layer, query_lens, seq_lens, segmented=False):
        contexts = [s - q for s, q in zip(seq_lens, query_lens)]
        q = torch.cat(
            [
                queries[layer][s][c : c + n]
                for s, (c, n) in enumerate(zip(contexts, query_lens))
            ]
        )
        out = torch.empty_like(q)
        key_cache, value_cache = key_value_views(caches[layer], HEAD_SIZE)
        descale = one.expand(len(seq_lens), NUM_KV_HEADS)
        extra = {}
        if segmented:  # the decode path that splits the softmax over segments
            rows, segments = 32, 16
            extra = dict(
                seq_threshold_3D=rows,
                num_par_softmax_segments=segments,
                softmax_segm_output=torch.empty(
                    rows, num_query_heads, segments, triton.next_power_of_2(HEAD_SIZE)
                ),
                softmax_segm_max=torch.empty(rows, num_query_heads, segments),
                softmax_segm_expsum=torch.empty(rows, num_query_heads, segments),
            )
        unified_attention(
            q=q,
            k=key_cache,
            v=value_cache,
            out=out,
            cu_seqlens_q=torch.tensor(
                [0, *torch.tensor(query_lens).cumsum(0)], dtype=torch.int32
            ),
            max_seqlen_q=max(query_lens),
            seqused_k=torch.tensor(seq_lens, dtype=torch.int32),
            max_seqlen_k=max(seq_lens),
            softmax_scale=scale,
            causal=True,
            window_size=(-1, -1),
            block_table=block_table,
            softcap=0,
            q_descale=None,
            k_descale=descale,
            v_descale=descale,
            **extra,
        )
        expected = torch.cat(
            [
                reference(
                    queries[layer][s][c : c + n],
                    keys[layer][s][:t],
                    values[layer][s][:t],
                    c,
                )
                for s, (c, n, t) in enumerate(zip(contexts, query_lens, seq_lens))
            ]
        )
        error = (out.float() - expected).abs().max().item()
        assert error < TOLERANCE, f"layer {layer}: max |out - reference| = {error:.3g}"

    for layer in range(LAYERS):  # prefill
        write(layer, [list(range(n)) for n in prompt_lens])
    check_cache(prompt_lens)
    for layer in range(LAYERS):
        attend(layer, prompt_lens, prompt_lens)
    for layer in range(LAYERS):  # one decode step
        write(layer, [[n] for n in prompt_lens])
    check_cache(total_lens)
    for layer in range(LAYERS):
        attend(layer, [1, 1], total_lens)
        attend(layer, [1, 1], total_lens, segmented=True)
    print("all checks passed")


if __name__ == "__main__":
    _run_case(int(sys.argv[1]))
