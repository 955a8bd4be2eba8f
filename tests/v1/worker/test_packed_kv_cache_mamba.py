# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Mamba (state-space) layers in a packed (cross-layer) KV cache, on CPU.

Settles suspect 1 of the fork's packed-KV audit. A hybrid attention + Mamba2
model (a tiny GraniteMoeHybrid: Mamba and full-attention layers alternating)
with the OffloadingConnector and ``enable_cross_layers_blocks``: vLLM's planner
packs one page of each group per block row, exactly as it does for GPT-OSS.
The attention views honour each layer's ``(offset, block_stride)``; the Mamba
branch of both model runners' reshape builds its state views at offset 0 with a
page-sized block stride, so Mamba layers alias each other and their neighbours'
pages. The OffloadingConnector refuses those caches at registration (a loud
start-up failure), so the fork's connector never runs on them.
"""

import json
from pathlib import Path

import pytest
import torch

import tests.v1.worker.per_backend_kv_layout  # noqa: F401 (skips without that API)
from tests.v1.worker.offload_e2e_configs import offload_transfer_config
from tests.v1.worker.test_packed_kv_cache_offload import register_kv_caches
from tests.v1.worker.test_packed_kv_cache_pipeline import allocate_and_reshape
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.model_executor.models import ModelRegistry
from vllm.platforms import current_platform
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.attention.backends.mamba2_attn import Mamba2AttentionBackend
from vllm.v1.attention.backends.utils import get_kv_cache_layout, set_kv_cache_layout
from vllm.v1.core.kv_cache_utils import (
    _use_packed_kv_cache_config,
    get_kv_cache_configs,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
)
from vllm.v1.worker.utils import AttentionGroup, prepare_kernel_block_sizes

# No distributed state or engine here: vLLM's per-test global cleanup (~0.7 s a case
# on CPU) is skipped, as its conftest allows for such unit tests.
pytestmark = [pytest.mark.cpu_test, pytest.mark.skip_global_cleanup]

NUM_KV_HEADS, HEAD_SIZE = 4, 64
NUM_BLOCKS = 8
ATTENTION_LAYER_TYPES = ("attention", "full_attention")  # HF spells it either way


def tiny_granite_hybrid_config(path: Path) -> str:
    """A GraniteMoeHybrid config with no weights: Mamba2 and attention alternating."""
    config = {
        "architectures": ["GraniteMoeHybridForCausalLM"],
        "model_type": "granitemoehybrid",
        "hidden_size": 256,
        "intermediate_size": 256,
        "shared_intermediate_size": 256,
        "num_attention_heads": NUM_KV_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "num_hidden_layers": 4,
        "layer_types": ["mamba", "attention"] * 2,
        "mamba_n_heads": 8,
        "mamba_d_head": 64,
        "mamba_d_state": 16,
        "mamba_n_groups": 1,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_chunk_size": 64,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "position_embedding_type": "nope",
        "vocab_size": 400,
        "max_position_embeddings": 4096,
        "dtype": "bfloat16",
    }
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def make_hybrid_mamba_offload_config(path: Path) -> VllmConfig:
    """The #47054 connector settings on a hybrid Mamba model, with prefix caching
    (which the offloading spec requires of hybrid models)."""
    vllm_config = VllmConfig(
        model_config=ModelConfig(
            model=tiny_granite_hybrid_config(path),
            skip_tokenizer_init=True,
            max_model_len=128,
            dtype="bfloat16",
        ),
        cache_config=CacheConfig(block_size=16, enable_prefix_caching=True),
        device_config=DeviceConfig(device="cpu"),
        kv_transfer_config=offload_transfer_config(cpu_block_size=None),
    )
    # On a GPU, update_block_size_for_backend() does this once the layers exist
    # and FlashAttention is their backend: grow the attention block until its
    # page covers a Mamba state, and pad the Mamba page to match.
    current_platform._align_hybrid_block_size(vllm_config, FlashAttentionBackend)
    return vllm_config


@pytest.fixture
def hybrid_mamba_offload_config(tmp_path, monkeypatch) -> VllmConfig:
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    return make_hybrid_mamba_offload_config(tmp_path)


def hybrid_layer_specs(vllm_config: VllmConfig) -> dict[str, KVCacheSpec]:
    """The specs the model's layers declare (as Attention / MambaBase build them),
    without instantiating the model: on CPU its layers would pick CPU backends."""
    cache_config = vllm_config.cache_config
    model_config = vllm_config.model_config
    model_cls, _ = ModelRegistry.resolve_model_cls(
        model_config.architecture, model_config=model_config
    )
    specs: dict[str, KVCacheSpec] = {}
    for i, layer_type in enumerate(model_config.hf_text_config.layer_types):
        if layer_type in ATTENTION_LAYER_TYPES:
            specs[f"model.layers.{i}.self_attn.attn"] = FullAttentionSpec(
                block_size=cache_config.block_size,
                num_kv_heads=NUM_KV_HEADS,
                head_size=HEAD_SIZE,
                dtype=model_config.dtype,
            )
        else:
            specs[f"model.layers.{i}.mamba"] = MambaSpec(
                shapes=tuple(model_cls.get_mamba_state_shape_from_config(vllm_config)),
                dtypes=model_cls.get_mamba_state_dtype_from_config(vllm_config),
                block_size=cache_config.mamba_block_size,
                page_size_padded=cache_config.mamba_page_size_padded,
                mamba_type="mamba2",
                mamba_cache_mode=cache_config.mamba_cache_mode,
            )
    return specs


def plan_hybrid(vllm_config: VllmConfig):
    """Plan NUM_BLOCKS block rows with vLLM's planner; attention groups on
    FlashAttention, Mamba groups on the Mamba2 backend."""
    specs = hybrid_layer_specs(vllm_config)
    page_bytes = next(iter(specs.values())).page_size_bytes
    (kv_cache_config,) = get_kv_cache_configs(
        vllm_config, [specs], [NUM_BLOCKS * 2 * page_bytes]
    )
    attn_groups = [
        [
            AttentionGroup(
                FlashAttentionBackend
                if isinstance(g.kv_cache_spec, FullAttentionSpec)
                else Mamba2AttentionBackend,
                list(g.layer_names),
                g.kv_cache_spec,
                i,
            )
        ]
        for i, g in enumerate(kv_cache_config.kv_cache_groups)
    ]
    kernel_block_sizes = prepare_kernel_block_sizes(kv_cache_config, attn_groups)
    return kv_cache_config, attn_groups, kernel_block_sizes, page_bytes


def build_views(vllm_config: VllmConfig, runner: str):
    with set_current_vllm_config(vllm_config):
        set_kv_cache_layout(None)  # no override: the connector decides (HND)
        try:
            kv_cache_config, attn_groups, kernel_block_sizes, page_bytes = plan_hybrid(
                vllm_config
            )
            raw, views = allocate_and_reshape(
                runner, kv_cache_config, attn_groups, kernel_block_sizes, vllm_config
            )
        finally:
            get_kv_cache_layout.cache_clear()
    return kv_cache_config, raw, views, page_bytes


def test_planner_packs_hybrid_mamba_model(hybrid_mamba_offload_config):
    """Settles the first half of suspect 1: yes, the 0.25.1 planner packs a
    hybrid attention + Mamba model with the connector settings a user would use."""
    vllm_config = hybrid_mamba_offload_config
    assert vllm_config.model_config.is_hybrid
    assert not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
    with set_current_vllm_config(vllm_config):
        kv_cache_config, _, _, page_bytes = plan_hybrid(vllm_config)
    groups = kv_cache_config.kv_cache_groups
    assert sorted(type(g.kv_cache_spec).__name__ for g in groups) == [
        "FullAttentionSpec",
        "MambaSpec",
    ]
    assert _use_packed_kv_cache_config(vllm_config, groups)
    tensors = kv_cache_config.kv_cache_tensors
    assert {t.block_stride for t in tensors} == {2 * page_bytes}
    assert sorted(t.offset for t in tensors) == [0, page_bytes]
    # Each slot is shared by one Mamba and one attention layer.
    for t in tensors:
        assert sorted(n.rsplit(".", 1)[-1] for n in t.shared_by) == ["attn", "mamba"]
    # Mamba in the config also turns on block zeroing (suspect 2).
    assert kv_cache_config.needs_kv_cache_zeroing


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="vLLM 0.25.1 (and 0.26.0, from reading): the Mamba branch of "
    "_reshape_kv_cache (v2) and GPUModelRunner._reshape_kv_cache_tensors (v1) ignores "
    "the packed (offset, block_stride): Mamba state views start at offset 0 with a "
    "page-sized block stride and overlap other layers' pages "
    "(docs/upstream-reports/packed-kv-mamba-state-views.md)",
)
@pytest.mark.parametrize("runner", ["v2", "v1"])
def test_mamba_state_views_stay_in_their_page(hybrid_mamba_offload_config, runner):
    """Settles the second half of suspect 1: writing a Mamba layer's states must
    touch only that layer's page of each block row. 0.25.1 writes elsewhere."""
    kv_cache_config, raw, views, page_bytes = build_views(
        hybrid_mamba_offload_config, runner
    )
    placement = {
        name: (t.offset, t.block_stride)
        for t in kv_cache_config.kv_cache_tensors
        for name in t.shared_by
    }
    mamba_layers = sorted(n for n in views if isinstance(views[n], list))
    assert len(mamba_layers) == 2
    for name in mamba_layers:
        offset, block_stride = placement[name]
        backing = raw[name]
        backing.zero_()
        for state in views[name]:
            state.fill_(1)
        rows = backing.view(-1, block_stride)
        others = torch.cat([rows[:, :offset], rows[:, offset + page_bytes :]], 1)
        assert not others.any(), f"{name}'s states wrote outside its page"
        backing.zero_()


def test_offloading_connector_refuses_packed_mamba_caches(hybrid_mamba_offload_config):
    """Settles the second half of suspect 1 for the fork's connector: the
    OffloadingConnector worker cannot rebuild a page tensor from the packed Mamba
    views and raises at KV cache registration (engine start-up), before any
    forward pass could write through the overlapping views. No silent corruption
    through the OffloadingConnector; other connectors are not covered here."""
    vllm_config = hybrid_mamba_offload_config
    kv_cache_config, _, views, _ = build_views(vllm_config, "v1")
    # It views the whole packed backing as (num_blocks, Mamba page), which is
    # block_stride / page times too small for it; no transfer worker is created.
    with pytest.raises(RuntimeError, match="invalid for input of size"):
        register_kv_caches(vllm_config, kv_cache_config, views)
