# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A limit of the packed KV cache that the fix does not lift: kernel block splitting.

When the attention backend cannot run the KV cache manager's block size, the
runners split each block into kernel blocks (``prepare_kernel_block_sizes``):
FlashInfer runs pages of 16, 32 or 64 tokens, so ``--block-size 128`` gives two
kernel blocks per block. In a packed block row, kernel block ``b`` of a layer
lies at ``(b // 2) * block_stride + offset + (b % 2) * kernel_page``: no single
stride walks that, so no view can. 0.25.1 (with or without the fix) and 0.26.0
fail such a plan at start-up (``RuntimeError: shape ... is invalid``) instead
of running on wrong bytes. Found by the planner property
(test_packed_kv_cache_planner.py), which leaves these plans out. Strict xfail:
the day the views become right, this case says so.
"""

import pytest
import torch

import tests.v1.worker.per_backend_kv_layout  # noqa: F401 (skips without that API)
from tests.v1.worker.test_packed_kv_cache_pipeline import (
    allocate_and_reshape,
    gpt_oss_offload_config,
)
from tests.v1.worker.test_packed_kv_cache_planner import (
    check_layer_views,
    check_plan,
    plan,
)
from tests.v1.worker.test_packed_kv_cache_reshape import kv_cache_layout
from vllm.config import set_current_vllm_config
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

# No distributed state or engine here: vLLM's per-test global cleanup (~0.7 s a case
# on CPU) is skipped, as its conftest allows for such unit tests.
pytestmark = [pytest.mark.cpu_test, pytest.mark.skip_global_cleanup]

flashinfer = pytest.importorskip(
    "vllm.v1.attention.backends.flashinfer",
    reason="needs FlashInfer's Python package (flashinfer-python)",
)

BLOCK_SIZE = 128  # FlashInfer's largest kernel page without trtllm-gen is 64
NUM_BLOCKS = 4


@pytest.mark.xfail(
    strict=True,
    raises=RuntimeError,
    reason="a packed block row cannot be viewed in kernel blocks smaller than its "
    "pages (vLLM 0.25.1 and 0.26.0 fail at start-up)",
)
@pytest.mark.parametrize("runner", ["v2", "v1"])
def test_packed_rows_split_into_kernel_blocks(tmp_path, runner):
    backend = flashinfer.FlashInferBackend
    config = gpt_oss_offload_config(tmp_path)
    config.cache_config.num_gpu_blocks_override = NUM_BLOCKS
    common = dict(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=64)
    specs = {
        "model.layers.0.self_attn.attn": SlidingWindowSpec(
            sliding_window=128, dtype=torch.bfloat16, **common
        ),
        "model.layers.1.self_attn.attn": FullAttentionSpec(
            dtype=torch.bfloat16, **common
        ),
    }
    with set_current_vllm_config(config), kv_cache_layout("HND"):
        kv_cache_config, attn_groups, kernel_block_sizes = plan(config, specs, backend)
        placement = check_plan(kv_cache_config)
        assert kernel_block_sizes == [64, 64]  # two kernel blocks per block
        raw, views = allocate_and_reshape(
            runner, kv_cache_config, attn_groups, kernel_block_sizes, config
        )
        stride_order = tuple(backend.get_kv_cache_stride_order())
    groups = kv_cache_config.kv_cache_groups
    check_layer_views(
        backend, stride_order, groups, kernel_block_sizes, raw, views, placement
    )
