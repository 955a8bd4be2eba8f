# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The dense reference of the GPU kernel tests, checked on CPU.

test_packed_kv_cache_gpu_kernels.py compares FlashAttention and Triton unified
attention, called as GPT-OSS calls them (attention sinks, a sliding window on
the sliding layers), with ``reference_attention``. Here that reference is
checked against closed forms, against causal SDPA (the previous reference) when
it has neither sinks nor a window, and against vLLM's Triton ``unified_attention``
with sinks and a window, run under Triton's interpreter on a plain (unpacked)
paged cache; and the window the GPU tests pass is checked against the one the
FlashAttention, Triton and FlashInfer backends derive from a layer's sliding
window.

The kernel case runs in a fresh interpreter (this file is also the worker
script), as in test_packed_kv_cache_triton_cpu.py: Triton's interpreter switch
and vLLM's Triton gate are read once, at import.
"""

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from tests.v1.worker.attention_reference import (
    backend_window_size,
    flashinfer_window_left,
    reference_attention,
)
from tests.v1.worker.triton_on_cpu import run_case_in_fresh_process

pytestmark = pytest.mark.cpu_test

NUM_QUERY_HEADS, NUM_KV_HEADS, HEAD_SIZE = 8, 2, 64
FLASHINFER_MISSING = (
    ""
    if importlib.util.find_spec("flashinfer")
    else "FlashInfer's Python package (flashinfer-python) is not installed"
)
SCALE = HEAD_SIZE**-0.5


def _random_qkv(seq_lens, query_lens=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    query_lens = seq_lens if query_lens is None else query_lens
    query = torch.randn(sum(query_lens), NUM_QUERY_HEADS, HEAD_SIZE, generator=gen)
    key = torch.randn(sum(seq_lens), NUM_KV_HEADS, HEAD_SIZE, generator=gen)
    value = torch.randn(sum(seq_lens), NUM_KV_HEADS, HEAD_SIZE, generator=gen)
    return query, key, value


def test_reference_without_sinks_or_window_is_causal_sdpa():
    """The reference the GPU tests used before: torch SDPA, causal, per sequence."""
    seq_lens = [70, 33, 129, 300]  # the GPU tests' sequences
    query, key, value = _random_qkv(seq_lens)
    group = NUM_QUERY_HEADS // NUM_KV_HEADS
    expected, start = [], 0
    for n in seq_lens:
        q = query[start : start + n].transpose(0, 1)
        k = key[start : start + n].repeat_interleave(group, 1).transpose(0, 1)
        v = value[start : start + n].repeat_interleave(group, 1).transpose(0, 1)
        expected.append(
            F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1)
        )
        start += n
    out = reference_attention(query, key, value, seq_lens, SCALE)
    torch.testing.assert_close(out, torch.cat(expected), atol=1e-5, rtol=1e-5)


def test_reference_window_of_one_and_sinks_in_closed_form():
    """Window 1: each query sees only its own key, so the output is that token's
    value times exp(s) / (exp(s) + exp(sink)) = sigmoid(s - sink), s its scaled
    score. Fixes both the window convention and the sinks' unscaled logits."""
    seq_lens, query_lens = [9, 5], [4, 5]
    query, key, value = _random_qkv(seq_lens, query_lens)
    sinks = torch.linspace(-2.0, 2.0, NUM_QUERY_HEADS)
    group = NUM_QUERY_HEADS // NUM_KV_HEADS
    # The key and value at each query's own position.
    own = torch.cat([torch.arange(9 - 4, 9), torch.arange(9, 9 + 5)])
    k = key[own].repeat_interleave(group, 1)
    v = value[own].repeat_interleave(group, 1)
    score = (query * k).sum(-1) * SCALE  # [tokens, heads]
    expected = v * torch.sigmoid(score - sinks)[..., None]
    out = reference_attention(
        query, key, value, seq_lens, SCALE, query_lens, sliding_window=1, sinks=sinks
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    out = reference_attention(
        query, key, value, seq_lens, SCALE, query_lens, sliding_window=1
    )
    torch.testing.assert_close(out, v, atol=1e-5, rtol=1e-5)


def test_reference_window_and_sinks_limits():
    """A window as long as the longest sequence, or sinks at -inf, change nothing;
    a shorter window or finite sinks do."""
    seq_lens = [40, 17]
    query, key, value = _random_qkv(seq_lens)
    plain = reference_attention(query, key, value, seq_lens, SCALE)
    wide = reference_attention(query, key, value, seq_lens, SCALE, sliding_window=40)
    torch.testing.assert_close(wide, plain, atol=0, rtol=0)
    no_sinks = torch.full((NUM_QUERY_HEADS,), -torch.inf)
    out = reference_attention(query, key, value, seq_lens, SCALE, sinks=no_sinks)
    torch.testing.assert_close(out, plain, atol=0, rtol=0)
    narrow = reference_attention(query, key, value, seq_lens, SCALE, sliding_window=8)
    assert not torch.allclose(narrow[:40], plain[:40])
    sinks = torch.zeros(NUM_QUERY_HEADS)
    assert not torch.allclose(
        reference_attention(query, key, value, seq_lens, SCALE, sinks=sinks), plain
    )


@pytest.mark.parametrize("sliding_window", [None, 1, 128])
@pytest.mark.parametrize(
    "backend",
    [
        "FLASH_ATTN",
        "TRITON_ATTN",
        pytest.param(
            "FLASHINFER",
            marks=pytest.mark.skipif(
                bool(FLASHINFER_MISSING), reason=FLASHINFER_MISSING
            ),
        ),
    ],
)
def test_backend_window_size_matches_backends(backend, sliding_window):
    """The window the GPU tests pass is the one the backend's attention impl
    derives from the layer's sliding window (a causal decoder layer); FlashInfer's
    kernels take its left edge (``window_left``)."""
    # (Imported here: this file is also the interpreter case's worker script, which
    # must set Triton up before anything imports vLLM.)
    from vllm.config import VllmConfig, set_current_vllm_config

    if backend == "FLASH_ATTN":
        from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl as impl
    elif backend == "TRITON_ATTN":
        from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl as impl
    else:
        from vllm.v1.attention.backends.flashinfer import FlashInferImpl as impl
    # (FlashInferImpl reads the current config for its workspace settings.)
    with set_current_vllm_config(VllmConfig()):
        layer = impl(
            num_heads=NUM_QUERY_HEADS,
            head_size=HEAD_SIZE,
            scale=SCALE,
            num_kv_heads=NUM_KV_HEADS,
            alibi_slopes=None,
            sliding_window=sliding_window,
            kv_cache_dtype="auto",
        )
    assert tuple(layer.sliding_window) == backend_window_size(sliding_window)
    if backend == "FLASHINFER":
        assert layer.window_left == flashinfer_window_left(sliding_window)


@pytest.mark.skipif(bool(FLASHINFER_MISSING), reason=FLASHINFER_MISSING)
@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_flashinfer_calls_of_the_gpu_test_fit_its_api(mode):
    """What test_packed_kv_cache_gpu_kernels.py hands FlashInfer, checked where no
    GPU runs it: the page table of its sequences, and every argument name of
    the wrapper calls against FlashInfer's own signatures."""
    import inspect

    import flashinfer

    # (Imported here: the GPU module needs the per-backend layout API.)
    from tests.v1.worker.test_packed_kv_cache_gpu_kernels import (
        BLOCK_SIZE,
        SEQ_LENS,
        flashinfer_plan_kwargs,
        paged_kv_table,
    )

    pages = [-(-n // BLOCK_SIZE) for n in SEQ_LENS]
    block_table = torch.arange(len(SEQ_LENS) * max(pages), dtype=torch.int32)
    block_table = block_table.view(len(SEQ_LENS), max(pages)).flip(1)
    indptr, indices, last_page_len = paged_kv_table(block_table, SEQ_LENS, BLOCK_SIZE)
    assert BLOCK_SIZE == 16 and SEQ_LENS == [70, 33, 129, 300]
    assert indptr.tolist() == [0, 5, 8, 17, 36]
    assert last_page_len.tolist() == [6, 1, 1, 12]
    assert indices.tolist() == [
        page for s, n in enumerate(pages) for page in block_table[s, :n].tolist()
    ]
    assert {t.dtype for t in (indptr, indices, last_page_len)} == {torch.int32}

    wrapper = (
        flashinfer.BatchPrefillWithPagedKVCacheWrapper
        if mode == "prefill"
        else flashinfer.BatchDecodeWithPagedKVCacheWrapper
    )
    query_lens = list(SEQ_LENS) if mode == "prefill" else [1] * len(SEQ_LENS)
    table = (indptr, indices, last_page_len)
    kwargs = flashinfer_plan_kwargs(mode, query_lens, table, 128, torch.bfloat16)
    # bind() raises TypeError on a name the method does not take
    inspect.signature(wrapper.__init__).bind(None, torch.empty(1), "HND")
    inspect.signature(wrapper.plan).bind(None, **kwargs)
    inspect.signature(wrapper.run).bind(None, torch.empty(1), torch.empty(1))
    assert kwargs["window_left"] == 127  # FlashInferImpl's, for a window of 128
    if mode == "prefill":
        assert kwargs["qo_indptr"].tolist() == [0, 70, 103, 232, 532]
        assert kwargs["causal"] is True


def test_triton_unified_attention_matches_reference():
    run_case_in_fresh_process(__file__, env={"TRITON_INTERPRET": "1"})


NUM_BLOCKS, BLOCK_SIZE = 16, 16
WINDOW = 24  # not a multiple of the block size; shorter than the first sequence
TOLERANCE = 5e-3  # fp16 kernel vs the fp32 reference


def _run_case() -> None:
    from tests.v1.worker.triton_on_cpu import enable_triton_on_cpu

    enable_triton_on_cpu()  # environment shims, before vLLM is imported

    from vllm.triton_utils import HAS_TRITON, triton
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention

    assert HAS_TRITON, "vLLM disabled Triton"
    torch.set_num_threads(1)
    dtype = torch.float16  # not bf16: the interpreter's tl.dot mishandles it
    gen = torch.Generator().manual_seed(0)

    # A plain paged cache, [blocks, block_size, KV heads, head size] for K and V,
    # over scattered blocks; block table rows zero-padded as the runner does.
    key_cache = torch.zeros(
        NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, dtype=dtype
    )
    value_cache = torch.zeros_like(key_cache)
    block_table = torch.zeros((2, 8), dtype=torch.int32)
    block_table[0, :3] = torch.tensor([3, 7, 1])
    block_table[1, :2] = torch.tensor([5, 2])
    seq_lens = [45, 12]  # the first is longer than the window, the second shorter
    total_lens = [n + 1 for n in seq_lens]  # plus one decode step

    def rand(*size):
        return torch.randn(*size, generator=gen).to(dtype)

    keys = [rand(n, NUM_KV_HEADS, HEAD_SIZE) for n in total_lens]
    values = [rand(n, NUM_KV_HEADS, HEAD_SIZE) for n in total_lens]
    queries = [rand(n, NUM_QUERY_HEADS, HEAD_SIZE) for n in total_lens]
    for s, n in enumerate(total_lens):
        for p in range(n):
            block = int(block_table[s, p // BLOCK_SIZE])
            key_cache[block, p % BLOCK_SIZE] = keys[s][p]
            value_cache[block, p % BLOCK_SIZE] = values[s][p]
    # Sink logits, one per query head, on both sides of the scores; bf16 like
    # GPT-OSS's (the kernel loads them as fp32; no tl.dot touches them).
    sinks = (torch.randn(NUM_QUERY_HEADS, generator=gen) * 2).to(torch.bfloat16)
    one = torch.tensor(1.0)

    def attend(query_lens, lens, sliding_window, use_sinks, segmented=False):
        q = torch.cat(
            [queries[s][n - m : n] for s, (m, n) in enumerate(zip(query_lens, lens))]
        )
        out = torch.empty_like(q)
        extra = {}
        if segmented:  # the decode path that splits the softmax over segments
            rows, segments = 32, 16
            extra = dict(
                seq_threshold_3D=rows,
                num_par_softmax_segments=segments,
                softmax_segm_output=torch.empty(
                    rows, NUM_QUERY_HEADS, segments, triton.next_power_of_2(HEAD_SIZE)
                ),
                softmax_segm_max=torch.empty(rows, NUM_QUERY_HEADS, segments),
                softmax_segm_expsum=torch.empty(rows, NUM_QUERY_HEADS, segments),
            )
        descale = one.expand(len(lens), NUM_KV_HEADS)
        # As TritonAttentionImpl.forward calls it (no alibi, softcap or fp8).
        unified_attention(
            q=q,
            k=key_cache,
            v=value_cache,
            out=out,
            cu_seqlens_q=torch.tensor(
                [0, *torch.tensor(query_lens).cumsum(0)], dtype=torch.int32
            ),
            max_seqlen_q=max(query_lens),
            seqused_k=torch.tensor(lens, dtype=torch.int32),
            max_seqlen_k=max(lens),
            softmax_scale=SCALE,
            causal=True,
            window_size=backend_window_size(sliding_window),
            block_table=block_table,
            softcap=0,
            q_descale=None,
            k_descale=descale,
            v_descale=descale,
            sinks=sinks if use_sinks else None,
            **extra,
        )

        def reference(window, with_sinks):
            return reference_attention(
                q,
                torch.cat([keys[s][:n] for s, n in enumerate(lens)]),
                torch.cat([values[s][:n] for s, n in enumerate(lens)]),
                lens,
                SCALE,
                query_lens,
                sliding_window=window,
                sinks=sinks if with_sinks else None,
            )

        case = (
            f"query_lens={query_lens} seq_lens={lens} window={sliding_window} "
            f"sinks={use_sinks} segmented={segmented}"
        )
        error = (out.float() - reference(sliding_window, use_sinks)).abs().max()
        assert error < TOLERANCE, f"{case}: max |out - ref| = {error:.3g}"
        print(f"{case}: max |out - ref| = {error:.3g}", flush=True)
        # The window and the sinks changed the output: the case tests them.
        if sliding_window is not None:
            change = (out.float() - reference(None, use_sinks)).abs().max()
            assert change > 10 * TOLERANCE, f"{case}: the window changed nothing"
        if use_sinks:
            change = (out.float() - reference(sliding_window, False)).abs().max()
            assert change > 10 * TOLERANCE, f"{case}: the sinks changed nothing"

    # The sliding layers' call (GPT-OSS), FA2's (window, no sinks), full layers'.
    for sliding_window, use_sinks in ((WINDOW, True), (WINDOW, False), (None, True)):
        attend(seq_lens, seq_lens, sliding_window, use_sinks)  # prefill
        attend([7, 3], seq_lens, sliding_window, use_sinks)  # chunked prefill
        attend([1, 1], total_lens, sliding_window, use_sinks)  # decode
        attend([1, 1], total_lens, sliding_window, use_sinks, segmented=True)
    print("all checks passed")


if __name__ == "__main__":
    _run_case()
