# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM's CUDA kernels over the packed cross-layer KV cache of vllm#47054.

The cache is planned, allocated and reshaped on the GPU by vLLM's own code
(GPT-OSS-like sliding + full groups, OffloadingConnector layout HND,
``num_kv_heads != block_size``); K/V are written with vLLM's cache-write op and
read by FlashAttention's paged varlen kernel (FA2, and FA3 on Hopper) and by
Triton unified attention, for every layer, and compared with a dense reference.
Without the fix the views are wrong and the kernels read past the pages (the
reported illegal memory access). Run with ``pytest --forked``: a crashed case
then fails alone.
"""

import pytest
import torch
import torch.nn.functional as F

from tests.v1.worker.test_packed_kv_cache_pipeline import (
    BLOCK_SIZE,
    HEAD_SIZE,
    NUM_KV_HEADS,
    gpt_oss_offload_config,
    layer_specs,
    reshape_v2,
)
from tests.v1.worker.test_packed_kv_cache_reshape import key_value_views
from vllm.platforms import current_platform

pytestmark = pytest.mark.skipif(
    not current_platform.is_cuda(),
    reason="needs an NVIDIA GPU: runs vLLM's CUDA cache and attention kernels",
)

NUM_QUERY_HEADS = 16
SEQ_LENS = [70, 33, 129]
NUM_GPU_BLOCKS = 64


@pytest.fixture
def packed_caches(tmp_path, monkeypatch):
    """Planner + allocation + reshape on CUDA, under the connector's layout."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.utils import (
        get_kv_cache_layout,
        set_kv_cache_layout,
    )
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
    from vllm.v1.worker.utils import AttentionGroup, prepare_kernel_block_sizes

    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)  # the connector decides
    offload_config = gpt_oss_offload_config(tmp_path)
    specs = layer_specs(offload_config)
    page_bytes = next(iter(specs.values())).page_size_bytes
    with set_current_vllm_config(offload_config):
        set_kv_cache_layout(None)
        try:
            assert get_kv_cache_layout() == "HND"
            (kv_cache_config,) = get_kv_cache_configs(
                offload_config, [specs], [NUM_GPU_BLOCKS * 2 * page_bytes]
            )
            attn_groups = [
                [
                    AttentionGroup(
                        FlashAttentionBackend, list(g.layer_names), g.kv_cache_spec, i
                    )
                ]
                for i, g in enumerate(kv_cache_config.kv_cache_groups)
            ]
            kernel_block_sizes = prepare_kernel_block_sizes(
                kv_cache_config, attn_groups
            )
            assert set(kernel_block_sizes) == {BLOCK_SIZE}
            _, views = reshape_v2(
                kv_cache_config, attn_groups, kernel_block_sizes, "cuda"
            )
        finally:
            get_kv_cache_layout.cache_clear()
    return kv_cache_config.num_blocks, views


def _write_sequences(views, num_blocks):
    """Write random K/V of every sequence into every layer with vLLM's cache op;
    return the K/V, queries and block table."""
    from vllm import _custom_ops as ops

    gen = torch.Generator(device="cuda").manual_seed(0)
    free = torch.randperm(num_blocks, generator=gen, device="cuda").tolist()
    width = max(-(-n // BLOCK_SIZE) for n in SEQ_LENS)
    block_table = torch.zeros((len(SEQ_LENS), width), dtype=torch.int32, device="cuda")
    for seq, seq_len in enumerate(SEQ_LENS):
        blocks = [free.pop() for _ in range(-(-seq_len // BLOCK_SIZE))]
        block_table[seq, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    slots = torch.cat(
        [
            block_table[seq, torch.arange(n, device="cuda") // BLOCK_SIZE].long()
            * BLOCK_SIZE
            + torch.arange(n, device="cuda") % BLOCK_SIZE
            for seq, n in enumerate(SEQ_LENS)
        ]
    )
    total = sum(SEQ_LENS)
    scale = torch.ones(1, dtype=torch.float32, device="cuda")
    data = {}
    for name, cache in views.items():
        key = torch.randn(total, NUM_KV_HEADS, HEAD_SIZE, generator=gen, device="cuda")
        value = torch.randn(
            total, NUM_KV_HEADS, HEAD_SIZE, generator=gen, device="cuda"
        )
        query = torch.randn(
            total, NUM_QUERY_HEADS, HEAD_SIZE, generator=gen, device="cuda"
        )
        key, value, query = (t.to(cache.dtype) for t in (key, value, query))
        key_cache, value_cache = key_value_views(cache, HEAD_SIZE)
        ops.reshape_and_cache_flash(
            key, value, key_cache, value_cache, slots, "auto", scale, scale
        )
        data[name] = (key, value, query)
    torch.cuda.synchronize()
    return data, block_table


def _reference(query, key, value):
    """Causal dense attention, sequence by sequence (torch SDPA, fp32)."""
    outputs, start = [], 0
    group = NUM_QUERY_HEADS // NUM_KV_HEADS
    for n in SEQ_LENS:
        q = query[start : start + n].float().transpose(0, 1)
        k = key[start : start + n].float().repeat_interleave(group, 1).transpose(0, 1)
        v = value[start : start + n].float().repeat_interleave(group, 1).transpose(0, 1)
        outputs.append(
            F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1)
        )
        start += n
    return torch.cat(outputs)


def _varlen_metadata():
    cu = torch.tensor(
        [0, *torch.tensor(SEQ_LENS).cumsum(0).tolist()], dtype=torch.int32
    )
    seqused = torch.tensor(SEQ_LENS, dtype=torch.int32)
    return cu.cuda(), seqused.cuda()


@pytest.mark.parametrize("fa_version", [2, 3])
def test_flash_attention_over_packed_views(packed_caches, fa_version):
    from vllm.vllm_flash_attn import flash_attn_varlen_func
    from vllm.vllm_flash_attn.flash_attn_interface import is_fa_version_supported

    if not is_fa_version_supported(fa_version):
        pytest.skip(f"FlashAttention {fa_version} is not supported on this GPU")
    num_blocks, views = packed_caches
    data, block_table = _write_sequences(views, num_blocks)
    cu_seqlens_q, seqused_k = _varlen_metadata()
    for name, cache in views.items():
        key, value, query = data[name]
        key_cache, value_cache = key_value_views(cache, HEAD_SIZE)
        out = flash_attn_varlen_func(
            q=query,
            k=key_cache,
            v=value_cache,
            max_seqlen_q=max(SEQ_LENS),
            cu_seqlens_q=cu_seqlens_q,
            max_seqlen_k=max(SEQ_LENS),
            seqused_k=seqused_k,
            softmax_scale=HEAD_SIZE**-0.5,
            causal=True,
            block_table=block_table,
            fa_version=fa_version,
        )
        torch.cuda.synchronize()
        torch.testing.assert_close(
            out.float(), _reference(query, key, value), atol=2e-2, rtol=2e-2, msg=name
        )


def test_triton_attention_over_packed_views(packed_caches):
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention

    num_blocks, views = packed_caches
    data, block_table = _write_sequences(views, num_blocks)
    cu_seqlens_q, seqused_k = _varlen_metadata()
    one = torch.ones(len(SEQ_LENS), NUM_KV_HEADS, dtype=torch.float32, device="cuda")
    for name, cache in views.items():
        key, value, query = data[name]
        key_cache, value_cache = key_value_views(cache, HEAD_SIZE)
        out = torch.empty_like(query)
        unified_attention(
            q=query,
            k=key_cache,
            v=value_cache,
            out=out,
            cu_seqlens_q=cu_seqlens_q,
            max_seqlen_q=max(SEQ_LENS),
            seqused_k=seqused_k,
            max_seqlen_k=max(SEQ_LENS),
            softmax_scale=HEAD_SIZE**-0.5,
            causal=True,
            window_size=(-1, -1),
            block_table=block_table,
            softcap=0,
            q_descale=None,
            k_descale=one,
            v_descale=one,
        )
        torch.cuda.synchronize()
        torch.testing.assert_close(
            out.float(), _reference(query, key, value), atol=2e-2, rtol=2e-2, msg=name
        )
