# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The DiffKV cache write puts every head where the cache's view reads it.

The diff-KV backends (FLASH_ATTN_DIFFKV, TRITON_ATTN_DIFFKV: models whose V head
size differs from K's, MiMo-V2) keep K and V of a head side by side in one cache
of logical shape ``(blocks, block_size, heads, head_size_k + head_size_v)`` and
write it with ``triton_reshape_and_cache_flash_diffkv``. Under the HND layout,
which the OffloadingConnector, NIXL and Mooncake ask for, their stride order puts
the heads before the slots. vLLM 0.25.1's kernel placed head ``i`` at
``i * (head_size_k + head_size_v)``, true only under NHD: under HND head ``i`` of
slot ``s`` landed on slot ``s + i`` of head 0, and the attention kernels, which
read with the cache's strides, got wrong K and V, silently. Patch 0004 passes the
cache's head stride to the kernel (vLLM 0.26.0's change).

The case allocates the cache, for each backend, as vLLM does (the backend's shape
permuted by its stride order under ``VLLM_KV_CACHE_LAYOUT=HND``; 0.26 names the heads
first in the logical shape, so the case takes either), runs vLLM's real Triton kernel
under Triton's interpreter on CPU tensors, and reads every token back through the
logical view: K and V of every head where the view reads them, nothing else written. The
same write into an NHD cache is the control (it was right before the patch and must stay
so). It fails on 0.25.1 and passes with patch 0004.

The case runs in a fresh interpreter (this file is also the worker script):
Triton's interpreter switch, vLLM's Triton gate and the KV cache layout are read
once, at import or first use. Replaced: nothing of the code under test; the
environment shims of ``triton_on_cpu.py`` make the real kernel runnable here.
"""

import sys

import pytest

from tests.v1.worker.triton_on_cpu import (
    enable_triton_on_cpu,
    run_case_in_fresh_process,
)

pytestmark = pytest.mark.cpu_test

# num_kv_heads != block_size: the HND and NHD orders must differ in memory.
NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS = 4, 16, 4
HEAD_SIZE_K, HEAD_SIZE_V = 32, 16
# Tokens spread over blocks and slots, the block table out of order.
SLOTS = [0, 1, 2, 15, 3 * 16 + 5, 3 * 16 + 6, 16 + 9, 16 + 15]

BACKENDS = {
    "FLASH_ATTN_DIFFKV": (
        "vllm.v1.attention.backends.flash_attn_diffkv",
        "FlashAttentionDiffKVBackend",
    ),
    "TRITON_ATTN_DIFFKV": (
        "vllm.v1.attention.backends.triton_attn_diffkv",
        "TritonAttentionDiffKVBackend",
    ),
}


def test_diffkv_cache_write_under_hnd():
    # Skips where vLLM no longer has the per-backend layout API (0.33's
    # KVCacheLayout rewrite); imported here, not at module level, because this
    # file is also the case process, which must set Triton up before vLLM loads.
    import tests.v1.worker.per_backend_kv_layout  # noqa: F401

    # One process for both backends: importing vLLM costs ~10 s of the case.
    run_case_in_fresh_process(
        __file__,
        *sorted(BACKENDS),
        env={"TRITON_INTERPRET": "1", "VLLM_KV_CACHE_LAYOUT": "HND"},
    )


def _write_and_check(cache, key, value, slots, head_major, layout):
    """Write KEY and VALUE into CACHE (a logical view) with vLLM's kernel and
    check every byte of the cache through that view."""
    import torch

    from vllm.v1.attention.ops.triton_reshape_and_cache_flash import (
        triton_reshape_and_cache_flash_diffkv,
    )

    scale = torch.tensor(1.0)
    # The kernel takes a (blocks, slots, heads, content) view, as the backends
    # pass it: a head-major logical cache is transposed for it.
    target = cache.transpose(1, 2) if head_major else cache
    triton_reshape_and_cache_flash_diffkv(
        key, value, target, torch.tensor(slots), "auto", scale, scale
    )
    expected = torch.zeros_like(cache)
    for token, slot in enumerate(slots):
        block, offset = divmod(slot, BLOCK_SIZE)
        # (block, slot, head, content) of the logical view, as [heads, content].
        cell = expected[block, :, offset] if head_major else expected[block, offset]
        cell[:, :HEAD_SIZE_K] = key[token]
        cell[:, HEAD_SIZE_K:] = value[token]
    wrong = (cache != expected).any(dim=-1).nonzero().tolist()
    assert not wrong, (
        f"{layout}: {len(wrong)} (block, slot, head) entries differ from the "
        f"tokens written, e.g. {wrong[:4]}"
    )


def _run_case(backend_name: str) -> None:
    import importlib

    import torch

    from vllm.v1.attention.backends.utils import get_kv_cache_layout

    assert get_kv_cache_layout() == "HND"
    module, name = BACKENDS[backend_name]
    backend = getattr(importlib.import_module(module), name)
    backend.set_head_size_v(HEAD_SIZE_V)
    shape = backend.get_kv_cache_shape(
        NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE_K
    )
    # 0.25 names the slots before the heads in the logical shape; 0.26 names the
    # heads first. Memory is what matters: both orders of the two are written.
    content = HEAD_SIZE_K + HEAD_SIZE_V
    head_major = shape == (NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, content)
    assert head_major or shape == (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, content)
    identity, swapped = (0, 1, 2, 3), (0, 2, 1, 3)
    hnd_order = backend.get_kv_cache_stride_order()
    # vLLM's own HND allocation is one of the two memory orders tested.
    assert hnd_order == (identity if head_major else swapped), hnd_order

    torch.manual_seed(0)
    key = torch.randn(len(SLOTS), NUM_KV_HEADS, HEAD_SIZE_K)
    value = torch.randn(len(SLOTS), NUM_KV_HEADS, HEAD_SIZE_V)
    for order in (identity, swapped):
        # As vLLM allocates it: memory in stride order, viewed back logically.
        physical = torch.zeros([shape[i] for i in order])
        cache = physical.permute(*[order.index(i) for i in range(len(shape))])
        assert cache.shape == shape
        heads_first_in_memory = head_major == (order == identity)
        layout = "HND" if heads_first_in_memory else "NHD"
        _write_and_check(
            cache, key, value, SLOTS, head_major, f"{backend_name} {layout}"
        )


if __name__ == "__main__":
    import traceback

    enable_triton_on_cpu()
    failures = []
    for name in sys.argv[1:]:
        try:
            _run_case(name)
        except AssertionError as error:
            failures.append(f"{name}: {error!r}\n{traceback.format_exc()}")
    assert not failures, "\n".join(failures)
    print("all checks passed")
