# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM's CUDA kernels over the packed cross-layer KV cache of vllm#47054.

The cache is planned, allocated and reshaped on the GPU by vLLM's own code
(GPT-OSS-like sliding + full groups, OffloadingConnector layout HND,
``num_kv_heads != block_size``); K/V are written with the cache write of the
backend that reads them (vLLM's CUDA op for FlashAttention and FlashInfer, Triton's
kernel for TRITON_ATTN) and read by FlashAttention's paged varlen kernel (FA2, and
FA3 on Hopper), by Triton unified attention and by FlashInfer's paged prefill and
decode (HND, the wrappers FlashInferImpl plans), for every layer, called as GPT-OSS's
layers call them:
the sliding layers with their window, and, where the kernel takes them (FA3,
Triton; FA2 refuses them), with attention sinks. Each output is compared with
``reference_attention`` (checked on CPU against vLLM's Triton kernel in
test_attention_reference_cpu.py). Without the fix the views are wrong and the
kernels read past the pages (the reported illegal memory access). Run with
``pytest --forked``: a crashed case then fails alone.
"""

import pytest
import torch

from tests.v1.worker.attention_reference import (
    backend_window_size,
    flashinfer_window_left,
    reference_attention,
)
from tests.v1.worker.test_packed_kv_cache_layer_views import key_value_views
from tests.v1.worker.test_packed_kv_cache_pipeline import (
    BLOCK_SIZE,
    HEAD_SIZE,
    NUM_KV_HEADS,
    gpt_oss_offload_config,
    layer_specs,
    reshape_v2,
)
from tests.v1.worker.test_packed_kv_cache_reshape import kv_cache_layout
from vllm.platforms import current_platform

pytestmark = pytest.mark.skipif(
    not current_platform.is_cuda(),
    reason="needs an NVIDIA GPU: runs vLLM's CUDA cache and attention kernels",
)

NUM_QUERY_HEADS = 16
# The sliding layers' window is 128 (the config's sliding_window): the last two
# sequences are longer, so their later queries no longer see their first keys.
# (Longer than the config's max_model_len, which only the planner reads.)
SEQ_LENS = [70, 33, 129, 300]
NUM_GPU_BLOCKS = 64
SCALE = HEAD_SIZE**-0.5
FLASHINFER_WORKSPACE_BYTES = 256 << 20


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
    # Each layer's sliding window, from its group's KV cache spec (None: full).
    windows = {
        name: getattr(group.kv_cache_spec, "sliding_window", None)
        for group in kv_cache_config.kv_cache_groups
        for name in group.layer_names
    }
    assert set(windows) == set(views)
    sliding = {w for w in windows.values() if w is not None}
    assert sliding and None in windows.values(), "expected sliding and full layers"
    assert max(SEQ_LENS) > max(sliding), "the window would change nothing"
    return kv_cache_config.num_blocks, views, windows


def sequence_inputs(views, num_blocks, device="cuda"):
    """Random K/V, queries and sinks of every sequence for every layer, the block
    table of the sequences (scattered blocks) and each token's cache slot."""
    gen = torch.Generator(device=device).manual_seed(0)
    free = torch.randperm(num_blocks, generator=gen, device=device).tolist()
    width = max(-(-n // BLOCK_SIZE) for n in SEQ_LENS)
    block_table = torch.zeros((len(SEQ_LENS), width), dtype=torch.int32, device=device)
    for seq, seq_len in enumerate(SEQ_LENS):
        blocks = [free.pop() for _ in range(-(-seq_len // BLOCK_SIZE))]
        block_table[seq, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    slots = torch.cat(
        [
            block_table[seq, torch.arange(n, device=device) // BLOCK_SIZE].long()
            * BLOCK_SIZE
            + torch.arange(n, device=device) % BLOCK_SIZE
            for seq, n in enumerate(SEQ_LENS)
        ]
    )
    total = sum(SEQ_LENS)
    data = {}
    for name, cache in views.items():
        key = torch.randn(total, NUM_KV_HEADS, HEAD_SIZE, generator=gen, device=device)
        value = torch.randn(
            total, NUM_KV_HEADS, HEAD_SIZE, generator=gen, device=device
        )
        query = torch.randn(
            total, NUM_QUERY_HEADS, HEAD_SIZE, generator=gen, device=device
        )
        key, value, query = (t.to(cache.dtype) for t in (key, value, query))
        # GPT-OSS's sinks: one logit per query head, a parameter in the model's
        # dtype (bf16, as FA3 requires), on both sides of the scores.
        sinks = torch.randn(NUM_QUERY_HEADS, generator=gen, device=device) * 2
        data[name] = (key, value, query, sinks.to(torch.bfloat16))
    return data, block_table, slots


def write_kv_args(key, value, cache, slots) -> tuple:
    """The arguments of vLLM's cache-write op that write KEY and VALUE into the
    layer's CACHE view at SLOTS, as FlashAttentionImpl.do_kv_cache_update passes
    them (bf16: the scales are ones)."""
    scale = torch.ones(1, dtype=torch.float32, device=key.device)
    key_cache, value_cache = key_value_views(cache, HEAD_SIZE)
    return key, value, key_cache, value_cache, slots, "auto", scale, scale


def write_kv(*args) -> None:
    """vLLM's cache-write op (``reshape_and_cache_flash``) on ARGS: write_kv_args()."""
    from vllm import _custom_ops as ops

    ops.reshape_and_cache_flash(*args)


def triton_write_kv(*args) -> None:
    """Triton's cache write on ARGS (write_kv_args()), the kernel and arguments of
    TritonAttentionImpl.do_kv_cache_update: it needs no compiled vLLM op."""
    from vllm.v1.attention.ops.triton_reshape_and_cache_flash import (
        triton_reshape_and_cache_flash,
    )

    triton_reshape_and_cache_flash(*args)


def _write_sequences(views, num_blocks, write=write_kv):
    """Write random K/V of every sequence into every layer with WRITE; return each
    layer's K/V, queries and sinks, and the block table."""
    data, block_table, slots = sequence_inputs(views, num_blocks)
    for name, cache in views.items():
        key, value, _, _ = data[name]
        write(*write_kv_args(key, value, cache, slots))
    torch.cuda.synchronize()
    return data, block_table


def varlen_metadata(device="cuda"):
    cu = torch.tensor(
        [0, *torch.tensor(SEQ_LENS).cumsum(0).tolist()], dtype=torch.int32
    )
    seqused = torch.tensor(SEQ_LENS, dtype=torch.int32)
    return cu.to(device), seqused.to(device)


def flash_attn_kwargs(
    fa_version, cache, query, sinks, sliding_window, block_table, metadata
) -> dict:
    """flash_attn_varlen_func's arguments for one layer, as FlashAttentionImpl.forward
    passes them (bf16: no descales); METADATA is varlen_metadata()."""
    cu_seqlens_q, seqused_k = metadata
    key_cache, value_cache = key_value_views(cache, HEAD_SIZE)
    return dict(
        q=query,
        k=key_cache,
        v=value_cache,
        max_seqlen_q=max(SEQ_LENS),
        cu_seqlens_q=cu_seqlens_q,
        max_seqlen_k=max(SEQ_LENS),
        seqused_k=seqused_k,
        softmax_scale=SCALE,
        causal=True,
        window_size=list(backend_window_size(sliding_window)),
        block_table=block_table,
        fa_version=fa_version,
        # FA2 raises NotImplementedError on s_aux: only FA3 gets GPT-OSS's sinks.
        s_aux=sinks if fa_version == 3 else None,
    )


def _assert_matches_reference(
    out, query, key, value, sliding_window, name, sinks=None, query_lens=None
):
    """OUT (after the kernel finished) equals reference_attention of the same inputs."""
    torch.cuda.synchronize()
    expected = reference_attention(
        query,
        key,
        value,
        SEQ_LENS,
        SCALE,
        query_lens=query_lens,
        sliding_window=sliding_window,
        sinks=sinks,
    )
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2, msg=name)


@pytest.mark.parametrize("fa_version", [2, 3])
def test_flash_attention_over_packed_views(packed_caches, fa_version):
    from vllm.vllm_flash_attn import flash_attn_varlen_func
    from vllm.vllm_flash_attn.flash_attn_interface import is_fa_version_supported

    if not is_fa_version_supported(fa_version):
        pytest.skip(f"FlashAttention {fa_version} is not supported on this GPU")
    num_blocks, views, windows = packed_caches
    data, block_table = _write_sequences(views, num_blocks)
    metadata = varlen_metadata()
    for name, cache in views.items():
        key, value, query, sinks = data[name]
        kwargs = flash_attn_kwargs(
            fa_version, cache, query, sinks, windows[name], block_table, metadata
        )
        out = flash_attn_varlen_func(**kwargs)
        _assert_matches_reference(
            out, query, key, value, windows[name], name, kwargs["s_aux"]
        )


def test_triton_attention_over_packed_views(packed_caches):
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention

    num_blocks, views, windows = packed_caches
    data, block_table = _write_sequences(views, num_blocks, triton_write_kv)
    cu_seqlens_q, seqused_k = varlen_metadata()
    one = torch.ones(len(SEQ_LENS), NUM_KV_HEADS, dtype=torch.float32, device="cuda")
    for name, cache in views.items():
        key, value, query, sinks = data[name]
        key_cache, value_cache = key_value_views(cache, HEAD_SIZE)
        out = torch.empty_like(query)
        # As TritonAttentionImpl.forward calls it (no alibi, softcap or fp8).
        unified_attention(
            q=query,
            k=key_cache,
            v=value_cache,
            out=out,
            cu_seqlens_q=cu_seqlens_q,
            max_seqlen_q=max(SEQ_LENS),
            seqused_k=seqused_k,
            max_seqlen_k=max(SEQ_LENS),
            softmax_scale=SCALE,
            causal=True,
            window_size=backend_window_size(windows[name]),
            block_table=block_table,
            softcap=0,
            q_descale=None,
            k_descale=one,
            v_descale=one,
            sinks=sinks,
        )
        _assert_matches_reference(out, query, key, value, windows[name], name, sinks)


def paged_kv_table(
    block_table: torch.Tensor, seq_lens: list[int], block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's page table of SEQ_LENS in BLOCK_TABLE (host tensors, int32):
    each sequence's pages in order (``indptr`` into ``indices``) and the tokens
    in its last page, as vLLM's FlashInfer metadata builder makes them."""
    pages = [-(-n // block_size) for n in seq_lens]
    indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()])
    indices = torch.cat([block_table[s, :p] for s, p in enumerate(pages)])
    last = [n - (p - 1) * block_size for n, p in zip(seq_lens, pages)]
    as_int = dict(dtype=torch.int32)
    return indptr.to(**as_int), indices.to(**as_int), torch.tensor(last, **as_int)


def flashinfer_plan_kwargs(
    mode: str,
    query_lens: list[int],
    table: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    sliding_window: int | None,
    dtype: torch.dtype,
) -> dict:
    """The keyword arguments of the FlashInfer wrapper's ``plan`` for MODE
    ("prefill": BatchPrefillWithPagedKVCacheWrapper, "decode":
    BatchDecodeWithPagedKVCacheWrapper), named as FlashInferMetadataBuilder
    passes them (bf16, no soft cap). Checked against FlashInfer's signatures on
    CPU (test_packed_kv_cache_attention.py)."""
    indptr, indices, last_page_len = table
    common = dict(
        num_qo_heads=NUM_QUERY_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        page_size=BLOCK_SIZE,
        sm_scale=SCALE,
        window_left=flashinfer_window_left(sliding_window),
        q_data_type=dtype,
        kv_data_type=dtype,
        o_data_type=dtype,
    )
    if mode == "prefill":
        qo_indptr = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()])
        return dict(
            qo_indptr=qo_indptr.to(torch.int32),
            paged_kv_indptr=indptr,
            paged_kv_indices=indices,
            paged_kv_last_page_len=last_page_len,
            head_dim_qk=HEAD_SIZE,
            causal=True,
            **common,
        )
    return dict(
        indptr=indptr,
        indices=indices,
        last_page_len=last_page_len,
        head_dim=HEAD_SIZE,
        **common,
    )


def flashinfer_wrapper(flashinfer, mode: str, workspace: torch.Tensor):
    """The paged wrapper FlashInferMetadataBuilder makes for MODE (the default
    backend, HND): decode with tensor cores, as FlashInferImpl builds it."""
    if mode == "prefill":
        return flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "HND")
    return flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "HND", use_tensor_cores=True
    )


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_flashinfer_over_packed_views(packed_caches, mode):
    """FlashInfer (Blackwell's default backend, HND like FlashAttention) reads the
    packed views as FlashInferImpl.forward passes them: permuted to the physical
    HND order, pages one block row apart. Prefill: every token of every
    sequence; decode: each sequence's last token over its whole cache. (GPT-OSS's
    sinks go to FlashInfer's trtllm-gen kernels on Blackwell only; the paged
    wrappers here are the ones every other layer uses, compared without sinks.)"""
    flashinfer = pytest.importorskip(
        "flashinfer", reason="needs FlashInfer (flashinfer-python, 0.25.1's cuda.txt)"
    )
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.flashinfer import FlashInferBackend

    num_blocks, views, windows = packed_caches
    # The views were planned with FlashAttention's declarations: FlashInfer's are
    # the same shape and the same HND order, so they are FlashInfer's views too.
    with kv_cache_layout("HND"):
        order = tuple(FlashInferBackend.get_kv_cache_stride_order())
        assert order == tuple(FlashAttentionBackend.get_kv_cache_stride_order())
    shape_args = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    assert FlashInferBackend.get_kv_cache_shape(
        *shape_args
    ) == FlashAttentionBackend.get_kv_cache_shape(*shape_args)

    data, block_table = _write_sequences(views, num_blocks)
    indptr, indices, last_page_len = paged_kv_table(
        block_table.cpu(), SEQ_LENS, BLOCK_SIZE
    )
    table = (indptr, indices.cuda(), last_page_len)
    query_lens = list(SEQ_LENS) if mode == "prefill" else [1] * len(SEQ_LENS)
    last_tokens = (torch.tensor(SEQ_LENS).cumsum(0) - 1).cuda()
    workspace = torch.zeros(
        FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device="cuda"
    )
    for name, cache in views.items():
        key, value, query, _ = data[name]
        if mode == "decode":
            query = query[last_tokens]
        wrapper = flashinfer_wrapper(flashinfer, mode, workspace)
        wrapper.plan(
            **flashinfer_plan_kwargs(
                mode, query_lens, table, windows[name], query.dtype
            )
        )
        out = wrapper.run(query, cache.permute(*order))
        _assert_matches_reference(
            out, query, key, value, windows[name], name, query_lens=query_lens
        )
