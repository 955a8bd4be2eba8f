"""KV-cache initialisation on CPU for a GPT-OSS-120B-sized packed plan.

36 layers alternating sliding-window and full attention, 8 KV heads, head size 64,
block size 16, bf16, the OffloadingConnector's cross-layer packing and HND layout;
vLLM's planner, allocator and v2 reshape. Reports wall time per step and whether the
views add memory beyond the raw allocation (they should not: views only).

Run inside the fork's tree:  cd build/vllm-0.25.1 && ../venv/bin/python \\
    ../../benchmarks/packed_kv_cache_init_cpu.py [--gib 4]
Writes one JSON object to stdout.
"""

from __future__ import annotations

import argparse
import json
import time

import psutil
import torch

from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.attention.backends.utils import get_kv_cache_layout, set_kv_cache_layout
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.worker.gpu.attn_utils import _allocate_kv_cache, _reshape_kv_cache
from vllm.v1.worker.utils import AttentionGroup, prepare_kernel_block_sizes

LAYERS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 36, 8, 64, 16


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--gib", type=float, default=4.0, help="KV cache memory to plan for"
    )
    args = parser.parse_args()
    set_kv_cache_layout("HND")
    get_kv_cache_layout.cache_clear()
    common = dict(
        block_size=BLOCK_SIZE,
        num_kv_heads=KV_HEADS,
        head_size=HEAD_SIZE,
        dtype=torch.bfloat16,
    )
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    groups = [
        KVCacheGroupSpec(names[0::2], SlidingWindowSpec(sliding_window=128, **common)),
        KVCacheGroupSpec(names[1::2], FullAttentionSpec(**common)),
    ]
    vllm_config = VllmConfig(
        cache_config=CacheConfig(block_size=BLOCK_SIZE),
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "spec_name": "CPUOffloadingSpec",
                "enable_cross_layers_blocks": "True",
                "cpu_bytes_to_use": 1 << 30,
            },
        ),
    )
    process = psutil.Process()
    t0 = time.perf_counter()
    config = get_kv_cache_config_from_groups(vllm_config, groups, int(args.gib * 2**30))
    t1 = time.perf_counter()
    raw = _allocate_kv_cache(config, {}, torch.device("cpu"))
    t2 = time.perf_counter()
    rss_before_reshape = process.memory_info().rss
    attn_groups = [
        [AttentionGroup(FlashAttentionBackend, list(g.layer_names), g.kv_cache_spec, i)]
        for i, g in enumerate(config.kv_cache_groups)
    ]
    views = _reshape_kv_cache(
        attn_groups=[g for gs in attn_groups for g in gs],
        kv_cache_raw_tensors=raw,
        cache_dtype="auto",
        kernel_block_sizes=prepare_kernel_block_sizes(config, attn_groups),
        shared_kv_cache_layers={},
        kv_cache_config=config,
    )
    t3 = time.perf_counter()
    rss_after_reshape = process.memory_info().rss

    raw_storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in raw.values()
    }
    view_storages = {v.untyped_storage().data_ptr() for v in views.values()}
    print(
        json.dumps(
            {
                "layers": LAYERS,
                "num_blocks": config.num_blocks,
                "kv_cache_tensors": len(config.kv_cache_tensors),
                "block_stride_bytes": config.kv_cache_tensors[0].block_stride,
                "raw_allocation_bytes": sum(raw_storages.values()),
                "plan_s": round(t1 - t0, 4),
                "allocate_s": round(t2 - t1, 4),
                "reshape_s": round(t3 - t2, 4),
                "views_outside_raw_storages": len(view_storages - set(raw_storages)),
                "rss_delta_during_reshape_bytes": rss_after_reshape
                - rss_before_reshape,
                "view_shape": list(next(iter(views.values())).shape),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
