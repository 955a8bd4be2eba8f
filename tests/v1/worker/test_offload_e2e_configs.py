# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Every engine configuration of the GPU end-to-end tests, built on CPU.

The GPU tests (test_packed_kv_cache_offload_e2e.py) run only on GPU hosts. Here
each of their configurations goes through vLLM's own EngineArgs, the
connector's layout, the planner and the offloading spec the connector would
create, so that a wrong argument or connector option fails in CPU CI. The
checks the GPU tests make of their workers' KV caches (offload_round_trip.py)
run here on caches planned and allocated by vLLM, packed and not, in HND order,
NHD order and 0.25.1's view, so that they are known to tell them apart; the TP
cases must leave each rank at least 2 KV heads.
"""

import importlib
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

import tests.v1.worker.per_backend_kv_layout  # noqa: F401 (skips without that API)
import vllm.config.vllm as vllm_config_module
from tests.v1.worker.offload_e2e_configs import (
    CASES,
    GPU_BLOCK_SIZE,
    MAX_TOKENS,
    NUM_PROMPTS,
    SLIDING_WINDOW,
    OffloadCase,
    engine_kwargs,
    full_blocks,
    offloading_spec_inputs,
    runner_env,
)
from tests.v1.worker.offload_round_trip import (
    KV_CACHE_INSPECTION,
    KV_CACHE_REPORT,
    KVCacheInspection,
    PackedKVCache,
    check_not_packed,
    check_packed,
    kv_cache_report,
    prompt_token_ids,
)
from tests.v1.worker.test_packed_kv_cache_pipeline import (
    BLOCK_SIZE,
    HEAD_SIZE,
    NUM_BLOCKS,
    NUM_KV_HEADS,
    gpt_oss_offload_config,
    layer_specs,
)
from tests.v1.worker.tiny_hybrid_model import make_tiny_gpt_oss
from vllm.config import set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.attention.backends.utils import get_kv_cache_layout, set_kv_cache_layout
from vllm.v1.core.kv_cache_utils import (
    _use_packed_kv_cache_config,
    get_kv_cache_configs,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.worker.gpu.attn_utils import _allocate_kv_cache

pytestmark = pytest.mark.cpu_test

TP_CASES = [case for case in CASES if case.tensor_parallel_size > 1]


@pytest.fixture(scope="module")
def tiny_model_for(tmp_path_factory) -> Callable[[OffloadCase], str]:
    """The tiny GPT-OSS of a case, generated once per head count (as the GPU test
    does): the default model for every case but those that set their heads."""
    folder = tmp_path_factory.mktemp("models")

    def tiny_model(case: OffloadCase) -> str:
        if case.tiny_model_heads is None:
            return str(make_tiny_gpt_oss(folder / "tiny-gpt-oss"))
        q, kv = case.tiny_model_heads
        return str(make_tiny_gpt_oss(folder / f"tiny-gpt-oss-q{q}-kv{kv}", q, kv))

    return tiny_model


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_gpu_e2e_configs_build(case, tiny_model_for, monkeypatch):
    tiny_model = tiny_model_for(case)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    # The environment the GPU test gives the case: its model runner.
    for key, value in runner_env(case).items():
        monkeypatch.setenv(key, value)
    use_v2 = case.model_runner == "v2"
    # GPU hosts have Triton; this CPU process has it disabled, and the V2 runner's
    # config check refuses to go on without it. Past that gate the check is vLLM's
    # own: the features V2 does not support yet fail here, not on the GPU.
    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", True)
    inspection = dict(worker_extension_cls=KV_CACHE_INSPECTION)

    baseline_config = EngineArgs(
        **engine_kwargs(case, tiny_model, offload=False, **inspection)
    ).create_engine_config()
    assert baseline_config.kv_transfer_config is None
    assert baseline_config.use_v2_model_runner is use_v2

    config = EngineArgs(
        **engine_kwargs(case, tiny_model, offload=True, **inspection)
    ).create_engine_config()
    assert config.use_v2_model_runner is use_v2
    assert config.parallel_config.worker_extension_cls == KV_CACHE_INSPECTION
    assert config.attention_config.backend.name == case.attn_backend
    assert config.parallel_config.tensor_parallel_size == case.tensor_parallel_size
    assert config.cache_config.block_size == GPU_BLOCK_SIZE
    assert config.cache_config.enable_prefix_caching
    assert config.scheduler_config.disable_hybrid_kv_cache_manager is False

    connector = KVConnectorFactory.get_connector_class(config.kv_transfer_config)
    assert connector.__name__ == "OffloadingConnector"
    assert connector.get_required_kvcache_layout(config) == "HND"

    specs = layer_specs(config)
    page_bytes = next(iter(specs.values())).page_size_bytes
    with set_current_vllm_config(config):
        (kv_cache_config,) = get_kv_cache_configs(
            config, [specs], [256 * 2 * page_bytes]
        )
        assert _use_packed_kv_cache_config(config, kv_cache_config.kv_cache_groups)
        # The spec the connector creates from the extra config: every option read.
        spec = OffloadingSpecFactory.create_spec(
            *offloading_spec_inputs(config, kv_cache_config)
        )
    assert type(spec).__name__ == "CPUOffloadingSpec"
    assert spec.eviction_policy == "lru"
    offloaded_block_size = case.cpu_block_size or GPU_BLOCK_SIZE
    # GPU blocks per offloaded block (named blocks_per_chunk from vLLM 0.26).
    per_chunk = getattr(spec, "blocks_per_chunk", None) or spec.block_size_factor
    assert per_chunk == offloaded_block_size // GPU_BLOCK_SIZE
    assert spec.num_blocks > 0


@pytest.mark.parametrize("case", TP_CASES, ids=lambda case: case.id)
def test_tp_cases_keep_two_kv_heads_per_rank(case, tiny_model_for, monkeypatch):
    """Under one KV head per rank a page's HND and NHD orders are the same bytes,
    so a head/token order defect under tensor parallelism could not show: each
    rank must keep at least 2 KV heads (and not GPU_BLOCK_SIZE of them: then the
    0.25.1 view has the right shape, see test_packed_kv_cache_reshape.py)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for key, value in runner_env(case).items():
        monkeypatch.setenv(key, value)
    config = EngineArgs(
        **engine_kwargs(case, tiny_model_for(case), offload=True)
    ).create_engine_config()
    assert config.parallel_config.tensor_parallel_size == case.tensor_parallel_size
    # What each rank's attention layers get (vLLM's own split of the KV heads).
    per_rank = config.model_config.get_num_kv_heads(config.parallel_config)
    assert per_rank >= 2, f"{per_rank} KV head(s) per rank"
    assert per_rank != GPU_BLOCK_SIZE
    assert {spec.num_kv_heads for spec in layer_specs(config).values()} == {per_rank}


def test_kv_cache_inspection_extends_the_workers():
    """vLLM adds the extension to the worker's bases only when no attribute of it
    is already on the worker class (WorkerWrapperBase.init_worker asserts it):
    the GPU workers, and the CPU worker the CPU engine test runs."""
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    # As vLLM resolves it (resolve_obj_by_qualname): module, then attribute.
    module, _, name = KV_CACHE_INSPECTION.rpartition(".")
    assert getattr(importlib.import_module(module), name) is KVCacheInspection
    assert callable(getattr(KVCacheInspection, KV_CACHE_REPORT))
    added = [name for name in dir(KVCacheInspection) if not name.startswith("__")]
    assert added == [KV_CACHE_REPORT]
    for worker_class in (Worker, CPUWorker):
        assert not hasattr(worker_class, KV_CACHE_REPORT), worker_class


def _report(vllm_config, hnd_order: bool = True) -> dict:
    """kv_cache_report of a worker holding VLLM_CONFIG's KV cache: planned by vLLM's
    planner and allocated by the v2 runner's code, in the layout the connector asks
    for (or VLLM_KV_CACHE_LAYOUT); each page viewed here, not by the release's
    reshape (the 0.25.1 bug is in that), in FlashAttention's logical shape ``(blocks,
    2, block, heads, dim)`` over bytes in HND order ``(2, heads, block, dim)``, or,
    with HND_ORDER false, over bytes in that logical order (0.25.1's packed view
    under HND; NHD's)."""
    specs = layer_specs(vllm_config)
    spec = next(iter(specs.values()))
    with set_current_vllm_config(vllm_config):
        set_kv_cache_layout(None)  # no override: the connector decides
        try:
            (kv_cache_config,) = get_kv_cache_configs(
                vllm_config, [specs], [NUM_BLOCKS * 2 * spec.page_size_bytes]
            )
            raw = _allocate_kv_cache(kv_cache_config, {}, torch.device("cpu"))
            num_blocks = kv_cache_config.num_blocks
            context = {}
            for tensor in kv_cache_config.kv_cache_tensors:
                row_bytes = tensor.block_stride or spec.page_size_bytes
                for name in tensor.shared_by:
                    rows = raw[name].view(-1, row_bytes)
                    page = rows[:, tensor.offset : tensor.offset + spec.page_size_bytes]
                    page = page.view(spec.dtype)
                    b, h, d = BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE
                    if hnd_order:
                        view = page.view(num_blocks, 2, h, b, d).transpose(2, 3)
                    else:
                        view = page.view(num_blocks, 2, b, h, d)
                        if get_kv_cache_layout() == "HND":  # as 0.25.1 permuted it
                            view = view.transpose(2, 3)
                    context[name] = SimpleNamespace(
                        kv_cache=view, attn_backend=FlashAttentionBackend
                    )
            model_runner = SimpleNamespace(
                kv_cache_config=kv_cache_config,
                compilation_config=SimpleNamespace(static_forward_context=context),
            )
            # In the layout set up above, as a worker would report it.
            return kv_cache_report(SimpleNamespace(model_runner=model_runner))
        finally:
            get_kv_cache_layout.cache_clear()


EXPECTED = PackedKVCache(
    backend="FLASH_ATTN",
    layer_types=("sliding_attention", "full_attention") * 2,  # tiny_gpt_oss_config
    num_kv_heads=NUM_KV_HEADS,
    head_size=HEAD_SIZE,
    block_size=BLOCK_SIZE,
    dtype_bytes=2,  # bfloat16
    num_blocks=NUM_BLOCKS,
)


@pytest.mark.skip_global_cleanup
def test_kv_cache_checks_tell_the_packed_hnd_cache(tmp_path, monkeypatch):
    """The checks the GPU tests make of their workers' KV caches pass on the packed
    HND cache of the #47054 configuration and refuse what it must not be. (The
    report of a real engine's worker is checked by the CPU engine test.)"""
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    packed = gpt_oss_offload_config(tmp_path)
    report = _report(packed)
    check_packed(report, EXPECTED)
    with pytest.raises(AssertionError, match="is packed"):
        check_not_packed(report)

    # The 0.25.1 views of the same bytes, the same plan under NHD, and the per-layer
    # plan without cross-layer blocks.
    with pytest.raises(AssertionError, match="shape"):
        check_packed(_report(packed, hnd_order=False), EXPECTED)
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "NHD")
    with pytest.raises(AssertionError, match="NHD"):
        check_packed(_report(packed, hnd_order=False), EXPECTED)
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT")
    report = _report(gpt_oss_offload_config(tmp_path, cross_layers=False))
    with pytest.raises(AssertionError, match="not packed"):
        check_packed(report, EXPECTED)
    check_not_packed(report)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_gpu_e2e_prompts_hit_alike(case, tiny_model_for):
    """The GPU test compares tokens after a CPU reload with tokens after a GPU
    prefix hit: its prompts must make both hits the same length, reach past the
    sliding window, fit the model length, and stay inside the tiny model's vocab."""
    import json
    from pathlib import Path

    tiny_model = tiny_model_for(case)
    offloaded = case.cpu_block_size or GPU_BLOCK_SIZE
    prompts = prompt_token_ids(
        NUM_PROMPTS, GPU_BLOCK_SIZE, offloaded, full_blocks=full_blocks(offloaded)
    )
    vocab = json.loads((Path(tiny_model) / "config.json").read_text())["vocab_size"]
    max_model_len = engine_kwargs(case, tiny_model, offload=False)["max_model_len"]
    for prompt in prompts:
        # Both leave at least the last token to compute and hit whole blocks.
        gpu_hit = (len(prompt) - 1) // GPU_BLOCK_SIZE * GPU_BLOCK_SIZE
        offload_hit = (len(prompt) - 1) // offloaded * offloaded
        assert gpu_hit == offload_hit > 0
        # A sliding-window group hits only when a window's worth of blocks is
        # cached before the hit's end: both hits must reach that far.
        assert gpu_hit >= SLIDING_WINDOW
        assert len(prompt) > SLIDING_WINDOW
        assert len(prompt) + MAX_TOKENS <= max_model_len
        assert max(prompt) < vocab
    assert len({tuple(p[:1]) for p in prompts}) == len(prompts), "prompts share a block"
