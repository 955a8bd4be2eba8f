# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Per-token-head KV scales of a single-group model behind the OffloadingConnector.

Triton's per-token-head KV cache dtypes (``int8_per_token_head``,
``fp8_per_token_head``) keep one float32 scale per (token, head) in padding after
each head's K and V, and ``TritonAttentionImpl._ensure_scale_caches`` carves the
scale views out of the layer's page, assuming the page is contiguous. The
OffloadingConnector asked for the cross-layer layout unconditionally
(``prefer_cross_layer_blocks``), so a model with one KV cache group (Llama, Qwen,
Mistral: any model with full attention only) on Triton got one buffer for all
layers with the heads outside the layers (HND): every layer's scale views fell on
other layers' cells and collided, and generations were wrong from the first request,
silently (vllm#48412, fixed by #49226: no cross-layer blocks for these dtypes).

Driven through the v1 model runner's own allocation (``initialize_kv_cache_tensors``,
which asks the KV transfer group for the layout) with the real OffloadingConnector
as that group, vLLM's planner, and Triton's real scale views: every layer's scales
must lie in its own cells' padding and no two layers may share a scale byte. The
KVCacheLayout API (0.33) has no cross-layer layout; there the same check runs on the
layout the connector resolves.

The fix itself (#49226, first in 0.27.0) is in the runner's choice of the layout,
``KVConnectorModelRunnerMixin.use_uniform_kv_cache``, so it holds for every connector
that prefers cross-layer blocks, not only the OffloadingConnector: NIXL and
MooncakeStore with ``enable_cross_layers_blocks``, and MultiConnector over such
connectors. The second test drives that choice with each real connector class as the
transfer group: with a per-token-head dtype it must decline the cross-layer layout
the connector asks for. It fails on 0.25.1 and on 0.26.0, whose strided scale views
(#44455) make the first test pass while the runner still picks cross-layer blocks;
from 0.29 the choice has left the model runner and the test skips.
"""

import contextlib
import dataclasses

import pytest
import torch

from tests.v1.worker.offload_e2e_configs import (
    offload_transfer_config,
    tiny_gpt_oss_config,
)
from tests.v1.worker.test_packed_kv_cache_scales import mark_bytes, padding_of
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
from vllm.v1 import kv_cache_interface
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVQuantMode,
    get_kv_quant_mode,
)
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

# No distributed state or engine here: vLLM's per-test global cleanup (~0.7 s a case
# on CPU) is skipped, as its conftest allows for such unit tests.
pytestmark = [pytest.mark.cpu_test, pytest.mark.skip_global_cleanup]

BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, NUM_LAYERS = 16, 2, 64, 4
NUM_QUERY_HEADS = 4
MAX_MODEL_LEN = BLOCK_SIZE * 8
NUM_BLOCKS = 16  # one request of MAX_MODEL_LEN, and the null block (0.33)
PER_TOKEN_HEAD_DTYPES = ["int8_per_token_head", "fp8_per_token_head"]
HAS_LAYOUT_API = hasattr(kv_cache_interface, "create_kv_cache_views")


def layer_name(index: int) -> str:
    return f"model.layers.{index}.self_attn.attn"


def single_group_config(path, cache_dtype: str) -> VllmConfig:
    """A model of full-attention layers only (one KV cache group; the GPT-OSS
    config's shapes, its sliding window unused) with the OffloadingConnector as a
    user configures it: no ``enable_cross_layers_blocks``."""
    vllm_config = VllmConfig(
        model_config=ModelConfig(
            model=tiny_gpt_oss_config(path, HEAD_SIZE, NUM_KV_HEADS),
            skip_tokenizer_init=True,
            max_model_len=MAX_MODEL_LEN,
            dtype="bfloat16",
        ),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, cache_dtype=cache_dtype),
        device_config=DeviceConfig(device="cpu"),
        kv_transfer_config=offload_transfer_config(None, cross_layers_blocks=False),
    )
    vllm_config.cache_config.num_gpu_blocks_override = NUM_BLOCKS
    return vllm_config


def layer_specs(vllm_config: VllmConfig, cache_dtype: str) -> dict:
    """The layers' specs as Triton attention layers declare them to the v1 runner
    (which adds the backend's ``indexes_kv_by_block_stride``; the layout API's
    backend adds the scales' padding instead)."""
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE,
        num_kv_heads=NUM_KV_HEADS,
        head_size=HEAD_SIZE,
        dtype=kv_cache_dtype_str_to_dtype(cache_dtype, None),
        kv_quant_mode=get_kv_quant_mode(cache_dtype),
    )
    if HAS_LAYOUT_API:
        spec = TritonAttentionBackend.customize_spec(spec)
    else:
        with set_current_vllm_config(vllm_config):
            indexes = TritonAttentionBackend.indexes_kv_by_block_stride()
        spec = dataclasses.replace(spec, indexes_kv_by_block_stride=indexes)
    return {layer_name(i): spec for i in range(NUM_LAYERS)}


@pytest.fixture
def offloading_connector_as_transfer_group(monkeypatch):
    """Make the real OffloadingConnector (worker role) the process's KV transfer
    group, as ``ensure_kv_transfer_initialized`` does in a worker (which also needs
    a distributed group this test does not set up)."""
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )

    def install(vllm_config, kv_cache_config):
        connector = OffloadingConnector(
            vllm_config, KVConnectorRole.WORKER, kv_cache_config
        )
        monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", connector)
        return connector

    return install


def runner_kv_caches(vllm_config, kv_cache_config) -> dict[str, torch.Tensor]:
    """Each layer's KV cache view, from the v1 model runner's
    ``initialize_kv_cache_tensors`` (GPT-OSS's and most models' runner): with a KV
    transfer group that prefers cross-layer blocks it allocates one buffer for all
    layers. A runner proper needs a GPU; this one holds only what the method reads,
    and its layers stand in for the model's attention layers."""
    if HAS_LAYOUT_API:
        from tests.v1.worker.test_packed_kv_cache_layout_pipeline import runner_views

        return runner_views("v1", vllm_config, kv_cache_config)

    from types import SimpleNamespace

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.utils import AttentionGroup, prepare_kernel_block_sizes

    attn_groups = [
        [
            AttentionGroup(
                TritonAttentionBackend, list(g.layer_names), g.kv_cache_spec, i
            )
        ]
        for i, g in enumerate(kv_cache_config.kv_cache_groups)
    ]
    runner = object.__new__(GPUModelRunner)
    runner.device = torch.device("cpu")
    runner.cache_config = vllm_config.cache_config
    runner.model_config = vllm_config.model_config
    runner.kv_cache_config = kv_cache_config
    runner.attn_groups = attn_groups
    runner.runner_only_attn_layers = set()
    runner.shared_kv_cache_layers = {}
    runner.kv_caches = []
    names = [n for g in kv_cache_config.kv_cache_groups for n in g.layer_names]
    runner.compilation_config = SimpleNamespace(
        static_forward_context={n: SimpleNamespace(kv_cache=None) for n in names}
    )
    kernel_block_sizes = prepare_kernel_block_sizes(kv_cache_config, attn_groups)
    with set_current_vllm_config(vllm_config):
        return runner.initialize_kv_cache_tensors(kv_cache_config, kernel_block_sizes)


def plan(vllm_config, specs):
    if HAS_LAYOUT_API:
        from tests.v1.worker.test_packed_kv_cache_layout_pipeline import plan

        return plan(vllm_config, specs)[1]
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

    with set_current_vllm_config(vllm_config):
        (kv_cache_config,) = get_kv_cache_configs(vllm_config, [specs], [1 << 30])
    return kv_cache_config


@contextlib.contextmanager
def layout_decided_by_the_connector():
    """Up to 0.26 the KV cache layout is a cached process-wide value: clear it around
    the case so the configured connector decides it (the layout API resolves it per
    plan instead)."""
    if HAS_LAYOUT_API:
        yield
        return
    from vllm.v1.attention.backends.utils import get_kv_cache_layout

    get_kv_cache_layout.cache_clear()
    try:
        yield
    finally:
        get_kv_cache_layout.cache_clear()


@pytest.mark.parametrize("cache_dtype", PER_TOKEN_HEAD_DTYPES)
def test_per_token_head_scales_stay_in_their_layer_behind_the_offloading_connector(
    tmp_path, offloading_connector_as_transfer_group, cache_dtype
):
    if cache_dtype not in TritonAttentionBackend.supported_kv_cache_dtypes:
        pytest.skip(f"this vLLM's Triton backend has no {cache_dtype} KV cache")
    vllm_config = single_group_config(tmp_path, cache_dtype)
    with layout_decided_by_the_connector():
        specs = layer_specs(vllm_config, cache_dtype)
        kv_cache_config = plan(vllm_config, specs)
        assert len(kv_cache_config.kv_cache_groups) == 1
        offloading_connector_as_transfer_group(vllm_config, kv_cache_config)
        views = runner_kv_caches(vllm_config, kv_cache_config)
    assert sorted(views) == sorted(specs)

    # Every byte any layer's view reaches, over the storages the views share.
    raws = {
        v.untyped_storage().data_ptr(): torch.empty(0, dtype=torch.int8).set_(
            v.untyped_storage()
        )
        for v in views.values()
    }
    claimed = {
        key: torch.zeros_like(raw, dtype=torch.bool) for key, raw in raws.items()
    }
    for name, view in views.items():
        key = view.untyped_storage().data_ptr()
        raw = raws[key]
        padding = padding_of(raw, view)
        impl = TritonAttentionImpl(
            num_heads=NUM_QUERY_HEADS,
            head_size=HEAD_SIZE,
            scale=HEAD_SIZE**-0.5,
            num_kv_heads=NUM_KV_HEADS,
            alibi_slopes=None,
            sliding_window=None,
            kv_cache_dtype=cache_dtype,
        )
        impl._ensure_scale_caches(view)
        mark_bytes(impl._k_scale_cache)
        mark_bytes(impl._v_scale_cache)
        scales = raw != 0
        raw.zero_()
        outside = int((scales & ~padding).sum())
        shared = int((scales & claimed[key]).sum())
        assert not outside and not shared, (
            f"{name}: {outside} scale bytes outside its own cells' padding, {shared} "
            f"shared with another layer's scales (views {tuple(view.shape)} strides "
            f"{view.stride()})"
        )
        claimed[key] |= scales


# The connectors of 0.25.1 whose ``prefer_cross_layer_blocks`` can be True, configured
# so that it is: each class's own property decides, in the transfer group's place.
CROSS_LAYER_CONNECTORS = [
    "OffloadingConnector",
    "NixlConnector",
    "MooncakeStoreConnector",
    "MultiConnector",
]


def cross_layer_transfer_config(connector: str) -> KVTransferConfig:
    """CONNECTOR configured for cross-layer blocks (the OffloadingConnector asks for
    them whatever its configuration; MultiConnector only when all of its connectors
    do: here NIXL for P/D and the OffloadingConnector for CPU offloading)."""
    offload = offload_transfer_config(None, cross_layers_blocks=False)
    if connector == "OffloadingConnector":
        return offload
    extra: dict = {"enable_cross_layers_blocks": "True"}
    if connector == "MultiConnector":
        extra = {
            "connectors": [
                {
                    "kv_connector": "NixlConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": extra,
                },
                {
                    "kv_connector": offload.kv_connector,
                    "kv_role": offload.kv_role,
                    "kv_connector_extra_config": offload.kv_connector_extra_config,
                },
            ]
        }
    return KVTransferConfig(
        kv_connector=connector, kv_role="kv_both", kv_connector_extra_config=extra
    )


def register_triton_layers(vllm_config: VllmConfig, specs: dict) -> None:
    """Put attention layers on Triton into the config's forward context, where NIXL
    looks up the backend (it prefers cross-layer blocks only on some). The model's
    own layers would pick the CPU backend on this host, so stand-ins through vLLM's
    layer interface (AttentionLayerBase) declare Triton and each layer's spec."""
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    class TritonLayer(AttentionLayerBase):
        def __init__(self, spec) -> None:
            self.spec = spec

        def get_attn_backend(self) -> type[TritonAttentionBackend]:
            return TritonAttentionBackend

        def get_kv_cache_spec(self, vllm_config: VllmConfig):
            return self.spec

    context = vllm_config.compilation_config.static_forward_context
    for name, spec in specs.items():
        context[name] = TritonLayer(spec)


@pytest.fixture
def cross_layer_transfer_group(monkeypatch):
    """Build the configured connector class, as vLLM's factory names it, and make it
    the process's KV transfer group. Only the OffloadingConnector's worker side runs
    on this host: NIXL's worker needs the nixl library's agent and MooncakeStore's
    the Mooncake store, so those (and MultiConnector over NIXL) are built with the
    scheduler role. The property the runner reads, ``prefer_cross_layer_blocks``, is
    the same class's either way."""
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    built = []

    def install(vllm_config: VllmConfig, kv_cache_config):
        transfer_config = vllm_config.kv_transfer_config
        connector_cls = KVConnectorFactory.get_connector_class(transfer_config)
        role = (
            KVConnectorRole.WORKER
            if transfer_config.kv_connector == "OffloadingConnector"
            else KVConnectorRole.SCHEDULER
        )
        connector = connector_cls(vllm_config, role, kv_cache_config)
        built.append(connector)
        monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", connector)
        return connector

    yield install
    # MooncakeStore's scheduler opens a ZMQ client to the store's lookup server; left
    # open, its socket blocks the ZMQ context's teardown (and the test process).
    for connector in built:
        scheduler = getattr(connector, "connector_scheduler", None)
        if (client := getattr(scheduler, "client", None)) is not None:
            client.close()


def single_attention_group(spec, layer_names: list[str]) -> list[list]:
    from vllm.v1.worker.utils import AttentionGroup

    return [[AttentionGroup(TritonAttentionBackend, layer_names, spec, 0)]]


@pytest.mark.parametrize("cache_dtype", PER_TOKEN_HEAD_DTYPES)
@pytest.mark.parametrize("connector", CROSS_LAYER_CONNECTORS)
def test_per_token_head_dtypes_decline_cross_layer_blocks(
    tmp_path, cross_layer_transfer_group, connector: str, cache_dtype: str
):
    if not hasattr(KVConnectorModelRunnerMixin, "use_uniform_kv_cache"):
        pytest.skip(
            "this vLLM's model runner has no use_uniform_kv_cache: the cross-layer "
            "layout is decided by the connector's layout (offloading/config.py)"
        )
    if cache_dtype not in TritonAttentionBackend.supported_kv_cache_dtypes:
        pytest.skip(f"this vLLM's Triton backend has no {cache_dtype} KV cache")
    vllm_config = single_group_config(tmp_path, cache_dtype)
    vllm_config.kv_transfer_config = cross_layer_transfer_config(connector)
    with layout_decided_by_the_connector(), set_current_vllm_config(vllm_config):
        specs = layer_specs(vllm_config, cache_dtype)
        kv_cache_config = plan(vllm_config, specs)
        (group,) = kv_cache_config.kv_cache_groups
        register_triton_layers(vllm_config, specs)
        transfer_group = cross_layer_transfer_group(vllm_config, kv_cache_config)
        # The case is the one that matters only if the connector does ask.
        assert transfer_group.prefer_cross_layer_blocks, connector

        # Without per-token-head scales the runner still packs the layers.
        unquantized = dataclasses.replace(
            group.kv_cache_spec,
            dtype=vllm_config.model_config.dtype,
            kv_quant_mode=KVQuantMode.NONE,
        )
        names = list(group.layer_names)
        groups = single_attention_group(unquantized, names)
        assert KVConnectorModelRunnerMixin.use_uniform_kv_cache(groups)

        groups = single_attention_group(group.kv_cache_spec, names)
        assert not KVConnectorModelRunnerMixin.use_uniform_kv_cache(groups), (
            f"{cache_dtype}: the runner packs all layers into cross-layer blocks "
            f"for {connector}, where each layer's scale views assume its own page"
        )
