# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Offloaded KV pages of a per-token-head KV cache dtype come back whole.

Triton's per-token-head KV cache dtypes (``int8_per_token_head``,
``fp8_per_token_head``) keep one float32 scale per (token, head) inline, after each
head's data, so a page is ``2 * block * heads * 4`` bytes longer than its data
(``AttentionSpec.page_size_bytes`` budgets them). On the OffloadingConnector's
per-layer path (a hybrid model such as GPT-OSS without ``enable_cross_layers_blocks``)
vLLM 0.25 gave each layer's data reference ``real_page_size_bytes``, the data alone,
as its transfer width: every store and load moved the page's first bytes only, and a
CPU hit brought back a page whose tail (the V data and scales of its last tokens) was
whatever the GPU block held before, silently (vllm#48411, fixed in 0.26.0).

Two cases:

- the CPU engine (one fresh process): vLLM's CPU engine serves a tiny GPT-OSS (two KV
  cache groups, not packed) with the real OffloadingConnector and an
  ``int8_per_token_head`` cache on vLLM's Triton backend, its kernels run by Triton's
  interpreter. A prompt is stored to host memory, the GPU prefix cache emptied and
  every GPU KV page zeroed (its blocks reused), the prompt run again: the connector
  must load its blocks from host memory, every restored page must equal, byte for
  byte (scales included), the page the store read, and the tokens must equal those
  of a GPU prefix-cache hit of the same length;
- the connector worker alone, for both dtypes and on every release of the version
  matrix (0.33.0 has no CPU engine here): vLLM's planner and the v1 model runner's
  views of the same layers, the connector worker's registration, a store and a load
  of some blocks of each group by the transfer worker, and the same page comparison.

Replaced, as in test_packed_kv_cache_offload_cpu_engine.py, each for its reason: the
CUDA transfer worker (host_copy_offloading.py: it copies, per data reference, the
width the reference gives, as the CUDA worker does; ``PageRecordingOffloadingWorker``
also keeps the pages its copies read and leave), the CPU platform's attention choice,
Triton's CPU gate and the sampler's Triton top-k/top-p.
"""

import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest

from tests.v1.worker.triton_on_cpu import (
    enable_triton_on_cpu,
    run_case_in_fresh_process,
)

pytestmark = pytest.mark.cpu_test

# Block size 32 (the CPU engine wants multiples of 32); one whole block to offload
# and a tail: the interpreter's cost grows with the prompt, the defect needs one page.
BLOCK_SIZE = 32
FULL_BLOCKS = 1
MAX_TOKENS = 2
CACHE_DTYPE = "int8_per_token_head"
HOST_BYTES = 16 << 20
TIMEOUT_S = 600


def test_cpu_hit_restores_per_token_head_pages_whole(tmp_path):
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or importlib.util.find_spec("vllm._C") is None:
        pytest.skip("needs vLLM's CPU engine (a CPU build with its vllm._C kernels)")
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

    if CACHE_DTYPE not in TritonAttentionBackend.supported_kv_cache_dtypes:
        pytest.skip(f"this vLLM's Triton backend has no {CACHE_DTYPE} KV cache")
    env = {
        "TRITON_INTERPRET": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the default claims most of the host
        "VLLM_KV_CACHE_LAYOUT": None,  # unset: the connector decides
    }
    started = time.monotonic()
    run_case_in_fresh_process(__file__, str(tmp_path), env=env, timeout=TIMEOUT_S)
    print(f"CPU hit on the CPU engine: {time.monotonic() - started:.0f} s")


# The connector worker's registration and a store and load of it, without an engine:
# the release's own planner and model-runner views, through whichever KV cache layout
# API this vLLM has (up to 0.26 the per-backend API, after that KVCacheLayout), so
# that it runs on every release of the version matrix. Small pages, few blocks.
WORKER_BLOCK_SIZE, WORKER_KV_HEADS, WORKER_HEAD_SIZE = 16, 4, 64
WORKER_NUM_BLOCKS = 16  # one request of max_model_len in both groups
PER_TOKEN_HEAD_DTYPES = ["int8_per_token_head", "fp8_per_token_head"]


def per_token_head_specs(cache_dtype: str) -> dict:
    """A GPT-OSS-like model's layer specs (sliding-window and full attention
    alternating: two KV cache groups) with CACHE_DTYPE, as the layers declare them."""
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1 import kv_cache_interface
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        SlidingWindowSpec,
        get_kv_quant_mode,
    )

    common = dict(
        block_size=WORKER_BLOCK_SIZE,
        num_kv_heads=WORKER_KV_HEADS,
        head_size=WORKER_HEAD_SIZE,
        dtype=kv_cache_dtype_str_to_dtype(cache_dtype, None),
        kv_quant_mode=get_kv_quant_mode(cache_dtype),
    )
    specs = {
        f"model.layers.{i}.self_attn.attn": SlidingWindowSpec(
            sliding_window=128, **common
        )
        if i % 2 == 0
        else FullAttentionSpec(**common)
        for i in range(4)
    }
    if hasattr(kv_cache_interface, "create_kv_cache_views"):
        # KVCacheLayout API: the backend adds the scales' padding to the spec.
        specs = {n: TritonAttentionBackend.customize_spec(s) for n, s in specs.items()}
    return specs


def offload_config_without_cross_layers(path: Path, cache_dtype: str):
    from tests.v1.worker.offload_e2e_configs import (
        offload_transfer_config,
        tiny_gpt_oss_config,
    )
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, VllmConfig

    vllm_config = VllmConfig(
        model_config=ModelConfig(
            model=tiny_gpt_oss_config(path, WORKER_HEAD_SIZE, WORKER_KV_HEADS),
            skip_tokenizer_init=True,
            max_model_len=64,
            dtype="bfloat16",
        ),
        cache_config=CacheConfig(block_size=WORKER_BLOCK_SIZE, cache_dtype=cache_dtype),
        device_config=DeviceConfig(device="cpu"),
        kv_transfer_config=offload_transfer_config(None, cross_layers_blocks=False),
    )
    vllm_config.cache_config.num_gpu_blocks_override = WORKER_NUM_BLOCKS
    return vllm_config


def planned_views(vllm_config, specs: dict):
    """The plan of vLLM's planner and each layer's KV cache view, as the v1 model
    runner (GPT-OSS's) builds it, under the layout the connector asks for."""
    from vllm.v1 import kv_cache_interface

    if hasattr(kv_cache_interface, "create_kv_cache_views"):
        from tests.v1.worker.test_packed_kv_cache_layout_pipeline import (
            plan,
            runner_views,
        )

        _, kv_cache_config = plan(vllm_config, specs)
        return kv_cache_config, runner_views("v1", vllm_config, kv_cache_config)

    from tests.v1.worker.test_packed_kv_cache_pipeline import reshape_v1
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
    from vllm.v1.attention.backends.utils import get_kv_cache_layout
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
    from vllm.v1.worker.utils import AttentionGroup, prepare_kernel_block_sizes

    with set_current_vllm_config(vllm_config):
        get_kv_cache_layout.cache_clear()
        try:
            assert get_kv_cache_layout() == "HND"  # the OffloadingConnector's
            (kv_cache_config,) = get_kv_cache_configs(vllm_config, [specs], [1 << 30])
            attn_groups = [
                [
                    AttentionGroup(
                        TritonAttentionBackend, list(g.layer_names), g.kv_cache_spec, i
                    )
                ]
                for i, g in enumerate(kv_cache_config.kv_cache_groups)
            ]
            kernel_block_sizes = prepare_kernel_block_sizes(
                kv_cache_config, attn_groups
            )
            _, views = reshape_v1(
                kv_cache_config, attn_groups, kernel_block_sizes, vllm_config
            )
        finally:
            get_kv_cache_layout.cache_clear()
    return kv_cache_config, views


def register_kv_caches(vllm_config, kv_cache_config, views):
    """The OffloadingConnector worker's registration of VIEWS: the canonical tensors
    and data references it hands the transfer worker."""
    import inspect

    from tests.v1.worker.offload_e2e_configs import offloading_spec_inputs
    from tests.v1.worker.test_packed_kv_cache_layout_pipeline import (
        recording_spec_class,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
        OffloadingConnectorWorker,
    )

    spec = recording_spec_class()(*offloading_spec_inputs(vllm_config, kv_cache_config))
    # The worker took the spec alone up to 0.25, the KV cache config beside it in
    # 0.26, and the engine's config too after that.
    parameters = inspect.signature(OffloadingConnectorWorker).parameters
    if "vllm_config" in parameters:
        worker = OffloadingConnectorWorker(spec, vllm_config, kv_cache_config)
    elif "kv_cache_config" in parameters:
        worker = OffloadingConnectorWorker(spec, kv_cache_config)
    else:
        worker = OffloadingConnectorWorker(spec)
    worker.register_kv_caches(views)
    return spec.canonical


@pytest.mark.skip_global_cleanup
@pytest.mark.parametrize("cache_dtype", PER_TOKEN_HEAD_DTYPES)
def test_offloaded_per_token_head_pages_round_trip_whole(tmp_path, cache_dtype):
    import torch

    from tests.v1.worker.host_copy_offloading import PageRecordingOffloadingWorker
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    if cache_dtype not in TritonAttentionBackend.supported_kv_cache_dtypes:
        pytest.skip(f"this vLLM's Triton backend has no {cache_dtype} KV cache")
    vllm_config = offload_config_without_cross_layers(tmp_path, cache_dtype)
    specs = per_token_head_specs(cache_dtype)
    kv_cache_config, views = planned_views(vllm_config, specs)
    assert len(kv_cache_config.kv_cache_groups) == 2
    canonical = register_kv_caches(vllm_config, kv_cache_config, views)
    # The per-layer path: a canonical tensor per KV cache tensor, rows of one page.
    page_bytes = next(iter(specs.values())).page_size_bytes
    assert len(canonical.tensors) == len(kv_cache_config.kv_cache_tensors) > 1
    assert {t.page_size_bytes for t in canonical.tensors} == {page_bytes}

    # Every byte of the KV cache random, some blocks of each group stored to host
    # memory by the transfer worker, the allocation zeroed (the blocks reused), the
    # blocks loaded back: every restored page must be the page the store read.
    gen = torch.Generator().manual_seed(0)
    storages = {v.untyped_storage().data_ptr(): v for v in views.values()}
    raws = [
        torch.empty(0, dtype=torch.int8).set_(v.untyped_storage())
        for v in storages.values()
    ]
    for raw in raws:
        raw.copy_(torch.randint(-128, 128, raw.shape, dtype=torch.int8, generator=gen))
    worker = PageRecordingOffloadingWorker(canonical, num_host_blocks=4)
    gpu_blocks, host_blocks = [1, 2, 3, 5], [0, 1, 2, 3]
    group_sizes, block_indices = [2, 2], [0, 0]
    worker.submit_store(
        0,
        GPULoadStoreSpec(gpu_blocks, group_sizes, block_indices),
        CPULoadStoreSpec(host_blocks),
    )
    for raw in raws:
        raw.zero_()
    worker.submit_load(
        1,
        CPULoadStoreSpec(host_blocks),
        GPULoadStoreSpec(gpu_blocks, group_sizes, block_indices),
    )
    assert [r.job_id for r in worker.get_finished()] == [0, 1]
    assert set(worker.restored) == set(worker.stored)
    wrong = {
        key: int((page != worker.stored[key]).sum())
        for key, page in worker.restored.items()
        if not torch.equal(page, worker.stored[key])
    }
    assert not wrong, (
        f"restored pages differ from the stored ones in these many of {page_bytes} "
        f"bytes, by (canonical tensor, host block): {wrong}"
    )


def _attention_on_triton() -> None:
    """Point the CPU platform's backend choice at TRITON_ATTN (CPU_ATTN has no
    per-token-head dtypes)."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, *a, **k):
        return AttentionBackendEnum.TRITON_ATTN.get_path()

    CpuPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)


def _sampler_without_triton() -> None:
    """Greedy sampling needs no top-k/top-p; the Triton version of that kernel fails
    under the interpreter, so take the torch path vLLM has beside it."""
    from vllm.v1.sample.ops import topk_topp_sampler

    topk_topp_sampler.HAS_TRITON = False


def _run_case(work: Path) -> None:
    enable_triton_on_cpu()
    _attention_on_triton()
    _sampler_without_triton()

    from tests.v1.worker.host_copy_offloading import PageRecordingOffloadingSpec
    from tests.v1.worker.offload_e2e_configs import offload_transfer_config
    from tests.v1.worker.offload_round_trip import (
        empty_gpu_prefix_cache,
        generate_alone,
        prompt_token_ids,
    )
    from tests.v1.worker.tiny_hybrid_model import make_tiny_gpt_oss
    from vllm import LLM

    model = make_tiny_gpt_oss(work / "tiny-gpt-oss")
    config = json.loads((model / "config.json").read_text())
    spec_class = PageRecordingOffloadingSpec
    workers = []
    get_worker = spec_class.get_worker

    def recording_get_worker(self, kv_caches):
        worker = get_worker(self, kv_caches)
        workers.append(worker)
        return worker

    spec_class.get_worker = recording_get_worker
    llm = LLM(
        model=str(model),
        dtype="float32",  # the interpreter's tl.dot mishandles bf16
        kv_cache_dtype=CACHE_DTYPE,
        max_model_len=256,
        block_size=BLOCK_SIZE,
        max_num_seqs=2,
        enable_prefix_caching=True,
        disable_hybrid_kv_cache_manager=False,
        attention_config={"backend": "TRITON_ATTN"},
        enforce_eager=True,
        seed=0,
        kv_transfer_config=offload_transfer_config(
            None,
            cpu_bytes=HOST_BYTES,
            spec_name=spec_class.__name__,
            spec_module_path=spec_class.__module__,
            cross_layers_blocks=False,
        ),
    )
    (worker,) = set(workers)
    # The per-layer path: one canonical tensor per KV cache tensor (a sliding and a
    # full layer share each), each page scales included, not one packed row.
    kv_heads, head_size = config["num_key_value_heads"], config["head_dim"]
    data_bytes = 2 * BLOCK_SIZE * kv_heads * head_size  # int8: one byte a value
    page_bytes = data_bytes + 2 * BLOCK_SIZE * kv_heads * 4  # float32 scales
    assert len(worker.device_rows) == config["num_hidden_layers"] // 2, (
        f"not the per-layer path: {len(worker.device_rows)} canonical tensors"
    )
    assert {rows.shape[1] for rows in worker.device_rows} == {page_bytes}
    assert len(worker.group_data_refs) == 2

    (prompt,) = prompt_token_ids(1, BLOCK_SIZE, BLOCK_SIZE, full_blocks=FULL_BLOCKS)
    cold = generate_alone(llm, prompt, MAX_TOKENS)  # stores the whole block
    hit = generate_alone(llm, prompt, MAX_TOKENS)  # from the GPU prefix cache
    assert hit.num_cached_tokens == FULL_BLOCKS * BLOCK_SIZE, hit
    assert worker.stored, "nothing was offloaded"

    # The GPU blocks are freed and reused: nothing of the stored pages is left there.
    empty_gpu_prefix_cache(llm)
    for rows in worker.device_rows:
        rows.zero_()
    reloaded = generate_alone(llm, prompt, MAX_TOKENS)  # from host memory
    print(f"cold {cold}\nhit {hit}\nreloaded {reloaded}")
    assert reloaded.num_cached_tokens == hit.num_cached_tokens, reloaded
    assert worker.restored, "nothing was loaded from host memory"
    assert set(worker.restored) <= set(worker.stored)

    wrong = []
    for key, page in worker.restored.items():
        differs = (page != worker.stored[key]).nonzero()
        if len(differs):
            first, last = int(differs[0]), int(differs[-1])
            wrong.append(
                f"tensor {key[0]} host block {key[1]}: {len(differs)} of "
                f"{page_bytes} bytes differ, bytes {first}..{last}"
            )
    assert not wrong, (
        f"restored pages differ from the stored ones (data {data_bytes} bytes, "
        f"page {page_bytes}): " + "; ".join(wrong)
    )
    assert reloaded.token_ids == hit.token_ids, (
        "tokens after a CPU hit differ from a GPU prefix-cache hit"
    )
    print("all checks passed")


if __name__ == "__main__":
    _run_case(Path(sys.argv[1]))
