# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The GPU kernel test's calls, checked up to the kernels without a GPU.

test_packed_kv_cache_gpu_kernels.py runs only where a GPU is. Here the same calls
(its own helpers: vLLM's cache write, FlashAttention 2, and FlashAttention 3 with
GPT-OSS's sinks and the sliding window) run with CPU tensors over packed views on
vLLM's CUDA build: vLLM's Python wrappers check the arguments, the real op schema
parses every one of them, and then the dispatcher refuses the CPU tensors, the first
point that only a GPU gets past. A wrong keyword, a missing argument or a wrong type
stops earlier, as the breakage cases show. Needs the CUDA build's compiled
extensions, which link the NVIDIA driver's library: ``make test`` loads them
through a stub of it (forkbuild/gpu/driver_stub.py, forkbuild/gpu/cuda_route.py).
"""

import inspect
from functools import partial

import pytest
import torch

from tests.v1.worker.test_packed_kv_cache_gpu_kernels import (
    BLOCK_SIZE,
    HEAD_SIZE,
    NUM_KV_HEADS,
    flash_attn_kwargs,
    sequence_inputs,
    varlen_metadata,
    write_kv,
    write_kv_args,
)
from tests.v1.worker.test_packed_kv_cache_layer_views import (
    gpt_oss_like_specs,
    key_value_views,
    views_per_backend_api,
)


def _cuda_build_reason() -> str | None:
    """Why the CUDA build's ops are not here (None when they are)."""
    try:
        # What CudaPlatform.import_kernels loads on a GPU host: the cache ops.
        import vllm._C_stable_libtorch  # noqa: F401
        from vllm.vllm_flash_attn import flash_attn_varlen_func  # noqa: F401
    except ImportError as exc:
        return f"needs vLLM's CUDA build and the driver library (or its stub): {exc}"
    if torch.cuda.is_available():
        return "a GPU is present: test_packed_kv_cache_gpu_kernels.py runs the kernels"
    return None


pytestmark = pytest.mark.skipif(
    _cuda_build_reason() is not None, reason=str(_cuda_build_reason())
)

NUM_BLOCKS = 64  # the sequences of the kernel test need 36 blocks
CACHE_WRITE = "_C_cache_ops::reshape_and_cache_flash"
FLASH_ATTENTION = {2: "_vllm_fa2_C::varlen_fwd", 3: "_vllm_fa3_C::fwd"}


class NotReached(AssertionError):
    """The call stopped before the op's dispatcher."""


def reach_dispatch(call, op: str) -> None:
    """Run CALL; it must get as far as OP's dispatcher refusing CPU tensors. (An op
    with CUDA kernels only parses its arguments against its schema first.)"""
    try:
        call()
    except NotImplementedError as exc:
        if f"Could not run '{op}' with arguments from the 'CPU' backend" in str(exc):
            return
        raise NotReached(f"{op} not reached: NotImplementedError: {exc}") from exc
    except Exception as exc:
        raise NotReached(f"{op} not reached: {type(exc).__name__}: {exc}") from exc
    raise AssertionError(f"{op} ran on CPU tensors")


@pytest.fixture(scope="module")
def packed():
    """Packed FlashAttention views of GPT-OSS-like layers (sliding and full, HND,
    every block row holding every layer's page), made by vLLM's reshape on CPU;
    the kernel test's inputs for them."""
    specs = gpt_oss_like_specs(NUM_KV_HEADS, BLOCK_SIZE, torch.bfloat16)
    assert {s.head_size for s in specs} == {HEAD_SIZE}
    views = views_per_backend_api(specs, NUM_BLOCKS).views
    named = {f"layer{i}": view for i, view in enumerate(views)}
    windows = {
        f"layer{i}": getattr(spec, "sliding_window", None)
        for i, spec in enumerate(specs)
    }
    assert set(windows.values()) == {128, None}
    data, block_table, slots = sequence_inputs(named, NUM_BLOCKS, device="cpu")
    return named, windows, data, block_table, slots


def test_cache_write_reaches_the_kernel(packed):
    views, _, data, _, slots = packed
    for name, cache in views.items():
        key, value, _, _ = data[name]
        args = write_kv_args(key, value, cache, slots)
        reach_dispatch(partial(write_kv, *args), CACHE_WRITE)


def test_triton_cache_write_takes_the_kernel_tests_arguments(packed):
    """The Triton case writes with write_kv_args() as TritonAttentionImpl passes them:
    each binds to triton_reshape_and_cache_flash's parameter of that role. (Its launch
    needs a GPU; test_packed_kv_cache_triton_cpu.py runs it under the interpreter.)"""
    from vllm.v1.attention.ops.triton_reshape_and_cache_flash import (
        triton_reshape_and_cache_flash,
    )

    views, _, data, _, slots = packed
    name, cache = next(iter(views.items()))
    key, value, _, _ = data[name]
    args = write_kv_args(key, value, cache, slots)
    bound = inspect.signature(triton_reshape_and_cache_flash).bind(*args).arguments
    assert bound["key"] is key and bound["value"] is value
    # The layer's own K and V views (not each other's), as TritonAttentionImpl unbinds.
    for role, view in zip(
        ("key_cache", "value_cache"), key_value_views(cache, HEAD_SIZE)
    ):
        assert bound[role].data_ptr() == view.data_ptr(), role
        assert bound[role].stride() == view.stride(), role
        assert bound[role].shape == (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    assert bound["slot_mapping"] is slots and bound["kv_cache_dtype"] == "auto"
    assert bound["k_scale"].dtype == bound["v_scale"].dtype == torch.float32


@pytest.mark.parametrize("fa_version", [2, 3])
def test_flash_attention_reaches_the_kernel(packed, fa_version):
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    views, windows, data, block_table, _ = packed
    metadata = varlen_metadata("cpu")
    for name, cache in views.items():
        _, _, query, sinks = data[name]
        kwargs = flash_attn_kwargs(
            fa_version, cache, query, sinks, windows[name], block_table, metadata
        )
        if fa_version == 3:
            assert kwargs["s_aux"] is sinks and kwargs["s_aux"].dtype == torch.bfloat16
        reach_dispatch(
            partial(flash_attn_varlen_func, **kwargs), FLASH_ATTENTION[fa_version]
        )


def _renamed(kwargs: dict, old: str, new: str) -> dict:
    kwargs = dict(kwargs)
    kwargs[new] = kwargs.pop(old)
    return kwargs


def _without(kwargs: dict, name: str) -> dict:
    return {k: v for k, v in kwargs.items() if k != name}


# Breakages of the FlashAttention call, each caught before the kernel: by Python
# (keywords), by flash_attn_varlen_func's own checks, or by the op's schema.
FLASH_ATTENTION_BREAKAGES = {
    "wrong keyword": lambda kw: _renamed(kw, "window_size", "window"),
    "missing argument": lambda kw: _without(kw, "seqused_k"),
    "window of rank 3": lambda kw: {**kw, "window_size": [127, 0, 0]},
    "float where the schema takes int": lambda kw: {
        **kw,
        "max_seqlen_q": float(kw["max_seqlen_q"]),
    },
    # (A 0-dim tensor would pass: the schema converts it to a float.)
    "tensor where the schema takes bool": lambda kw: {
        **kw,
        "causal": torch.ones(2, dtype=torch.bool),
    },
    "sinks to FA2": lambda kw: {**kw, "fa_version": 2},
}


@pytest.mark.parametrize("breakage", sorted(FLASH_ATTENTION_BREAKAGES))
def test_a_broken_flash_attention_call_does_not_reach_the_kernel(packed, breakage):
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    views, windows, data, block_table, _ = packed
    name = next(n for n, w in windows.items() if w is not None)
    _, _, query, sinks = data[name]
    kwargs = flash_attn_kwargs(
        3, views[name], query, sinks, windows[name], block_table, varlen_metadata("cpu")
    )
    broken = FLASH_ATTENTION_BREAKAGES[breakage](kwargs)
    with pytest.raises(NotReached):
        reach_dispatch(lambda: flash_attn_varlen_func(**broken), FLASH_ATTENTION[3])


# Breakages of the cache write's arguments (write_kv_args), each caught before the
# kernel: by vLLM's wrapper (the argument count) or by the op's schema (the types).
CACHE_WRITE_BREAKAGES = {
    "missing argument": lambda args: args[:-1],
    "None where the schema takes str": lambda args: (*args[:5], None, *args[6:]),
    "int where the schema takes a tensor": lambda args: (*args[:6], 1, args[7]),
}


@pytest.mark.parametrize("breakage", sorted(CACHE_WRITE_BREAKAGES))
def test_a_broken_cache_write_does_not_reach_the_kernel(packed, breakage):
    views, _, data, _, slots = packed
    name, cache = next(iter(views.items()))
    key, value, _, _ = data[name]
    args = write_kv_args(key, value, cache, slots)
    broken = CACHE_WRITE_BREAKAGES[breakage](args)
    reach_dispatch(partial(write_kv, *args), CACHE_WRITE)
    with pytest.raises(NotReached):
        reach_dispatch(partial(write_kv, *broken), CACHE_WRITE)
