# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Packed KV block rows from the planner to the CPU-offload round trip (layout API).

The setup of vllm#47054 (a GPT-OSS-shaped hybrid model: sliding-window and full
attention layers, two KV cache groups; the OffloadingConnector with the CPU
offloading spec) walked through vLLM's own code:

1. the KV cache layout is resolved as the engine resolves it, and the planner
   places every group's layers as that layout says: one page per layer in each
   block row when the layout is block-outermost (``BLHNC``, ``BLNHC``), one region
   per layer otherwise;
2. the model runner (v1 and v2) builds each layer's ``[B, H, N, C]`` view of the
   packed allocation: each walks its own page in the layout's physical order;
3. the OffloadingConnector worker registers the views as one block-row tensor with a
   full-row reference per group, and a store and load of some rows (the bytes the
   CUDA transfer worker would copy) brings every layer's K and V back exactly, in
   its page, in physical order.

Only the transfer worker is left out: the CPU offloading spec creates it on CUDA or
XPU only. (The per-backend API before the layout rewrite has its own modules; there
this one skips.)
"""

from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import pytest
import torch

from tests.v1.worker.offload_e2e_configs import (
    SLIDING_WINDOW,
    offload_transfer_config,
    offloading_spec_inputs,
    tiny_gpt_oss_config,
)
from tests.v1.worker.test_packed_kv_cache_layer_views import (
    LAYOUT_API_ONLY,
    PackedViews,
    check_packed_layer_views,
)
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    SlidingWindowSpec,
)

if TYPE_CHECKING:  # only the KVCacheLayout API has it
    from vllm.v1.kv_cache_layout import KVCacheLayout

pytestmark = [
    pytest.mark.cpu_test,
    pytest.mark.skip_global_cleanup,
    LAYOUT_API_ONLY,
]

BLOCK_SIZE = 16
NUM_KV_HEADS = 4  # != BLOCK_SIZE: a view with H and N swapped would show
HEAD_SIZE = 64
NUM_LAYERS = 4  # tiny_gpt_oss_config's
NUM_BLOCKS = 32  # enough for one request of max_model_len in every group


def layer_name(index: int) -> str:
    return f"model.layers.{index}.self_attn.attn"


def gpt_oss_offload_config(path: Path) -> VllmConfig:
    """The #47054 configuration on a GPT-OSS config without weights (shapes only)."""
    vllm_config = VllmConfig(
        model_config=ModelConfig(
            model=tiny_gpt_oss_config(path, HEAD_SIZE, NUM_KV_HEADS),
            skip_tokenizer_init=True,
            max_model_len=128,
            dtype="bfloat16",
        ),
        cache_config=CacheConfig(block_size=BLOCK_SIZE),
        device_config=DeviceConfig(device="cpu"),
        kv_transfer_config=offload_transfer_config(None),
    )
    vllm_config.cache_config.num_gpu_blocks_override = NUM_BLOCKS
    return vllm_config


# KV heads of the full-attention layers: GPT-OSS's (one page size for all layers), or
# 6, whose page is not a multiple of the sliding layers': the planner then packs the
# layer kinds into separate groups of one row (block-outermost layouts) or pads the
# smaller pages (layer-compact ones), and the views must follow its strides.
PAGES = {"equal": NUM_KV_HEADS, "unequal": 6}


def layer_specs(full_kv_heads: int = NUM_KV_HEADS) -> dict[str, AttentionSpec]:
    """The layers' KV cache specs as GPT-OSS's attention layers declare them."""
    common = dict(block_size=BLOCK_SIZE, head_size=HEAD_SIZE, dtype=torch.bfloat16)
    return {
        layer_name(i): SlidingWindowSpec(
            sliding_window=SLIDING_WINDOW, num_kv_heads=NUM_KV_HEADS, **common
        )
        if i % 2 == 0
        else FullAttentionSpec(num_kv_heads=full_kv_heads, **common)
        for i in range(NUM_LAYERS)
    }


def view_shape(spec: AttentionSpec) -> tuple[int, ...]:
    """[blocks, heads, tokens, K and V side by side]: the KVCacheLayout API's views."""
    return (NUM_BLOCKS, spec.num_kv_heads, spec.block_size, 2 * spec.head_size)


def plan(
    vllm_config: VllmConfig, specs: dict[str, AttentionSpec]
) -> tuple["KVCacheLayout", KVCacheConfig]:
    """The engine core's KV cache planning: resolve the layout (the backend's supported
    set, VLLM_KV_CACHE_LAYOUT, the connector's wish), group, place."""
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )
    from vllm.v1.core.kv_cache_planning import (
        get_global_kv_cache_groups,
        get_kv_cache_configs,
    )

    supported = [
        [
            layout.name
            for layout in get_supported_kv_cache_layouts([TritonAttentionBackend])
        ]
    ]
    with set_current_vllm_config(vllm_config):
        layout = resolve_kv_cache_layout(vllm_config, supported, specs.values())
        groups = get_global_kv_cache_groups(vllm_config, [specs])
        (kv_cache_config,) = get_kv_cache_configs(
            vllm_config, [specs], [1 << 30], groups
        )
    kv_cache_config.kv_cache_layout = vllm_config.cache_config.kv_cache_layout
    return layout, kv_cache_config


def runner_views(
    runner: str, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> dict[str, torch.Tensor]:
    """Each layer's KV cache view, as the model runner builds it from the plan."""
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
    from vllm.v1.worker.utils import AttentionGroup, prepare_kernel_block_sizes

    attn_groups = [
        [
            AttentionGroup(
                TritonAttentionBackend, list(g.layer_names), g.kv_cache_spec, i
            )
        ]
        for i, g in enumerate(kv_cache_config.kv_cache_groups)
    ]
    kernel_block_sizes = prepare_kernel_block_sizes(kv_cache_config, attn_groups)
    device = torch.device("cpu")
    if runner == "v2":
        from vllm.v1.worker.gpu.attn_utils import init_kv_cache

        # No attention layers to bind in the forward context: only the views return.
        return init_kv_cache(
            {}, kv_cache_config, device, kernel_block_sizes, vllm_config
        )
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    # The v1 runner's own method; a runner proper needs a GPU, so this one holds
    # only what initialize_kv_cache_tensors reads. The layers it binds the views to
    # stand in for the model's attention layers.
    bound: dict = {}
    names = [n for g in kv_cache_config.kv_cache_groups for n in g.layer_names]
    runner_obj = object.__new__(GPUModelRunner)
    runner_obj.device = device
    runner_obj.cache_config = vllm_config.cache_config
    runner_obj.model_config = vllm_config.model_config
    runner_obj.shared_kv_cache_layers = {}
    runner_obj.attn_groups = attn_groups
    runner_obj.speculative_config = None
    runner_obj.kv_caches = []
    runner_obj.compilation_config = SimpleNamespace(
        static_forward_context={
            name: SimpleNamespace(
                bind_kv_cache=lambda cache, n=name: bound.update({n: cache})
            )
            for name in names
        }
    )
    return runner_obj.initialize_kv_cache_tensors(kv_cache_config, kernel_block_sizes)


def recording_spec_class():
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    class RecordingCPUOffloadingSpec(CPUOffloadingSpec):
        """The real spec, except for the transfer worker it creates: that worker
        needs CUDA (pinned host memory, streams, a CUDA copy kernel). Registration is
        all the connector's own code."""

        canonical = None

        def get_worker(self, kv_caches):
            self.canonical = kv_caches
            return None

    return RecordingCPUOffloadingSpec


def register(
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig,
    views: dict[str, torch.Tensor],
):
    """The OffloadingConnector worker's registration of the runner's views; returns the
    spec, which holds the canonical tensors the transfer worker would get."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
        OffloadingConnectorWorker,
    )

    spec = recording_spec_class()(*offloading_spec_inputs(vllm_config, kv_cache_config))
    worker = OffloadingConnectorWorker(spec, vllm_config, kv_cache_config)
    worker.register_kv_caches(views)
    return spec


@pytest.fixture
def layout_env(monkeypatch):
    def choose(name: str | None) -> None:
        if name is None:
            monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
        else:
            monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", name)

    return choose


def check_views(
    kv_cache_config: KVCacheConfig,
    layout: "KVCacheLayout",
    specs: dict[str, AttentionSpec],
    views: dict[str, torch.Tensor],
) -> dict[str, int]:
    """Each tensor's views walk their pages as placed; returns each layer's byte offset
    in its tensor's block."""
    placement = {}
    for tensor in kv_cache_config.kv_cache_tensors:
        spec = specs[tensor.layers[0]]
        first = views[tensor.layers[0]]
        raw = torch.empty(0, dtype=torch.int8).set_(first.untyped_storage())
        packed = PackedViews(
            raw[tensor.offset : tensor.offset + tensor.size],
            [views[name] for name in tensor.layers],
            layout.layer_view_order,
            spec.page_size_bytes,
            tensor.block_stride,
            tensor.layer_stride,
        )
        check_packed_layer_views(packed, view_shape(spec), spec.dtype)
        for index, name in enumerate(tensor.layers):
            placement[name] = tensor.offset + index * tensor.layer_stride
        raw.zero_()
    return placement


def check_block_ids_apart(
    kv_cache_config: KVCacheConfig, specs: dict[str, AttentionSpec]
) -> None:
    """The groups' tensors overlay one allocation, which is sound because a block id
    belongs to one group at a time: the bytes of a block id (its page of every layer of
    every group) must never be another block id's."""
    end = max(t.offset + t.size for t in kv_cache_config.kv_cache_tensors)
    owner = torch.full((end,), -1, dtype=torch.int64)
    for tensor in kv_cache_config.kv_cache_tensors:
        page = specs[tensor.layers[0]].page_size_bytes
        for index in range(len(tensor.layers)):
            for block in range(kv_cache_config.num_blocks):
                start = tensor.offset + index * tensor.layer_stride
                start += block * tensor.block_stride
                held = owner[start : start + page]
                others = held[(held != -1) & (held != block)].unique().tolist()
                assert not others, (
                    f"{tensor.layers[index]}: block {block} shares bytes with blocks "
                    f"{others}"
                )
                held.fill_(block)


@pytest.mark.parametrize("pages", list(PAGES))
@pytest.mark.parametrize("chosen", [None, "LBHNC", "LBNHC", "BLHNC", "BLNHC"])
def test_the_resolved_layout_decides_where_each_layer_lies(
    tmp_path, layout_env, chosen, pages
):
    layout_env(chosen)  # None: the connector's own choice
    vllm_config = gpt_oss_offload_config(tmp_path)
    specs = layer_specs(PAGES[pages])
    layout, kv_cache_config = plan(vllm_config, specs)
    if chosen is None:  # the layout the connector class asks for
        from vllm.distributed.kv_transfer.kv_connector.utils import (
            get_kv_connector_cache_layout,
        )

        assert layout.name == get_kv_connector_cache_layout(vllm_config)
    else:
        assert layout.name == chosen
    assert vllm_config.cache_config.kv_cache_layout == layout.name
    assert kv_cache_config.num_blocks == NUM_BLOCKS
    for tensor in kv_cache_config.kv_cache_tensors:
        if layout.is_block_outermost:  # a block row holds a page of each layer
            assert tensor.block_stride >= len(tensor.layers) * tensor.layer_stride
        else:  # each layer a region of its own
            assert tensor.layer_stride == NUM_BLOCKS * tensor.block_stride

    # The allocation's views, as both model runners get them from the plan.
    from vllm.v1.worker.utils import allocate_kv_cache

    check_block_ids_apart(kv_cache_config, specs)
    views = allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout)
    assert sorted(views) == sorted(specs)
    check_views(kv_cache_config, layout, specs, views)


@pytest.mark.parametrize("pages", list(PAGES))
@pytest.mark.parametrize("runner", ["v1", "v2"])
@pytest.mark.parametrize("layout_name", ["BLHNC", "BLNHC"])
def test_offload_round_trip_on_packed_block_rows(
    tmp_path, layout_env, layout_name, runner, pages
):
    layout_env(layout_name)
    vllm_config = gpt_oss_offload_config(tmp_path)
    specs = layer_specs(PAGES[pages])
    layout, kv_cache_config = plan(vllm_config, specs)
    assert layout.name == layout_name and layout.is_block_outermost
    check_block_ids_apart(kv_cache_config, specs)

    views = runner_views(runner, vllm_config, kv_cache_config)
    assert sorted(views) == sorted(specs)
    order = layout.layer_view_order
    placement = check_views(kv_cache_config, layout, specs, views)
    block_strides = {t.block_stride for t in kv_cache_config.kv_cache_tensors}
    raw = torch.empty(0, dtype=torch.int8).set_(views[layer_name(0)].untyped_storage())

    # The groups' tensors overlay one allocation with one row length.
    (block_stride,) = block_strides
    spec = register(vllm_config, kv_cache_config, views)
    (canonical,) = spec.canonical.tensors
    rows = canonical.tensor
    assert rows.dtype == torch.int8
    assert tuple(rows.shape) == (NUM_BLOCKS, block_stride)
    assert canonical.page_size_bytes == block_stride  # a transfer moves whole rows
    assert rows.data_ptr() == raw.data_ptr()
    # Each group moves whole block rows: the pages of every layer packed there.
    groups = kv_cache_config.kv_cache_groups
    assert len(spec.canonical.group_data_refs) == len(groups)
    for refs in spec.canonical.group_data_refs:
        assert [(r.tensor_idx, r.page_size_bytes) for r in refs] == [(0, block_stride)]

    # The block pool gives the groups disjoint block ids (their tensors overlay).
    owned = {g: [1 + 3 * g, 2 + 3 * g, 3 + 3 * g] for g in range(len(groups))}
    group_of = {name: i for i, g in enumerate(groups) for name in g.layer_names}
    gen = torch.Generator().manual_seed(0)
    truth = {}
    for name, view in views.items():
        blocks = owned[group_of[name]]
        truth[name] = torch.randn(
            (len(blocks), *view_shape(specs[name])[1:]), generator=gen
        ).to(torch.bfloat16)
        view[blocks] = truth[name]

    # The bytes are where the kernels look for them: each layer's page of its
    # blocks, in the layout's physical order.
    for name in views:
        blocks = owned[group_of[name]]
        page = specs[name].page_size_bytes
        physical_shape = [view_shape(specs[name])[i] for i in order]
        start = placement[name]
        stored = rows[blocks, start : start + page].contiguous()
        physical = stored.view(torch.bfloat16).view(len(blocks), *physical_shape[1:])
        assert torch.equal(physical, truth[name].permute(*order)), name

    # A store of some blocks to host memory: of each, the bytes a transfer moves (the
    # canonical tensor's page). Then the device blocks are freed and reused: nothing
    # of them is left. Then a load of the same blocks back.
    moved = [1, 3, 5, 6, 8]  # some blocks of every group, not all
    transfer = canonical.page_size_bytes
    host = rows[moved, :transfer].clone()
    raw.zero_()
    rows[moved, :transfer] = host

    # Every layer reads its stored blocks back exactly through its view, and nothing
    # of the others.
    for name, view in views.items():
        for index, block in enumerate(owned[group_of[name]]):
            if block in moved:
                assert torch.equal(view[block], truth[name][index]), (
                    f"{name}: block {block} did not round-trip"
                )
            else:
                assert not view[block].any(), f"{name}: block {block} was loaded"
