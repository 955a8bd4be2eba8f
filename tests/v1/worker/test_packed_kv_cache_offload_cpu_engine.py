# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The vllm#47054 configuration end to end, on vLLM's CPU engine.

The engine serves a tiny GPT-OSS (sliding-window + full attention: two KV cache
groups) with the OffloadingConnector and ``enable_cross_layers_blocks``, prefix
caching and the hybrid KV cache manager on, so vLLM's planner packs both groups
into shared block rows and the connector switches the layout to HND, exactly
as on a GPU. Attention is vLLM's Triton backend (FlashAttention's cache shape
and HND stride order), its real kernels run by Triton's interpreter. The
round trip (offload_round_trip.py, shared with the GPU test): store to host
memory, empty the GPU prefix cache, reload; the tokens must equal a baseline
engine's after a prefix-cache hit, and the connector's counters must move; the
worker's KV cache, reported through ``collective_rpc`` as in the GPU tests,
must be packed block rows in HND order (the baseline's not packed).
Without the fix the engine dies in the Triton attention path, the CPU
counterpart of the GPU's illegal memory access.

What is replaced, and why (the rest is the real engine):

- the offload transfer worker, through the connector's own extension point
  (``spec_name`` + ``spec_module_path``): 0.25.1's worker needs CUDA
  (host_copy_offloading.py);
- the CPU platform's attention-backend choice: 0.25.1's CPU platform always
  answers CPU_ATTN, whose cache layout has no stride order, so the bug cannot
  show; here it answers TRITON_ATTN;
- Triton on CPU (triton_on_cpu.py), and the sampler's Triton top-k/top-p
  kernel off: that kernel fails under the interpreter.

The engine core runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so these
shims reach it; the baseline is the same engine without the connector (no
packing, NHD), so both runs use the same kernels and dtype (float32: the
interpreter's ``tl.dot`` mishandles bf16). Each case runs in a fresh process:
the interpreter and vLLM's Triton gate are read once, at import, and a kernel
that writes out of bounds may kill its process.
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

# Block size 32 (the CPU engine wants multiples of 32), 2 KV heads: under HND the
# 0.25.1 view swaps exactly these two dimensions, so they must differ. Two full
# blocks and a tail (75 tokens): the interpreter's attention cost grows with the
# square of the prompt, and the packing needs the two groups, not a long prompt.
BLOCK_SIZE = 32
FULL_BLOCKS = 2
MAX_TOKENS = 3
FILLER_TOKENS = 2
HOST_BYTES = 64 << 20
TIMEOUT_S = 600


def test_offload_round_trip_on_the_cpu_engine(tmp_path):
    # Imported here, not at module level: the case process must set Triton up for
    # the CPU before anything imports vLLM. Skips without the per-backend API.
    import tests.v1.worker.per_backend_kv_layout  # noqa: F401
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or importlib.util.find_spec("vllm._C") is None:
        pytest.skip("needs vLLM's CPU engine (a CPU build with its vllm._C kernels)")
    from packaging.version import Version

    from vllm import __version__ as vllm_version

    if Version(vllm_version).release[:2] >= (0, 26):
        # Measured on 0.26.0: its engine hands the attention layers the packed
        # cache in another shape than 0.25's, which check_packed does not read.
        pytest.skip(
            "the packing check reads the KV cache views of the 0.24-0.25 engine"
        )
    env = {
        "TRITON_INTERPRET": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the default claims most of the host
        "VLLM_KV_CACHE_LAYOUT": None,  # unset: the connector decides
    }
    started = time.monotonic()
    run_case_in_fresh_process(__file__, str(tmp_path), env=env, timeout=TIMEOUT_S)
    print(f"round trip on the CPU engine: {time.monotonic() - started:.0f} s")


def _attention_on_triton() -> None:
    """Point the CPU platform's backend choice at TRITON_ATTN."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, *a, **k):
        return AttentionBackendEnum.TRITON_ATTN.get_path()

    CpuPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)


def _sampler_without_triton() -> None:
    """Greedy sampling needs no top-k/top-p; the Triton version of that kernel
    fails under the interpreter, so take the torch path vLLM has beside it."""
    from vllm.v1.sample.ops import topk_topp_sampler

    topk_topp_sampler.HAS_TRITON = False


def _run_case(work: Path) -> None:
    enable_triton_on_cpu()
    _attention_on_triton()
    _sampler_without_triton()

    from tests.v1.worker.host_copy_offloading import (
        HostCopyOffloadingSpec,
        HostCopyOffloadingWorker,
    )
    from tests.v1.worker.offload_e2e_configs import offload_transfer_config
    from tests.v1.worker.offload_round_trip import (
        KV_CACHE_INSPECTION,
        PackedKVCache,
        prompt_token_ids,
        run_round_trip,
    )
    from tests.v1.worker.tiny_hybrid_model import make_tiny_gpt_oss
    from vllm import LLM

    model = make_tiny_gpt_oss(work / "tiny-gpt-oss")
    model_config = json.loads((model / "config.json").read_text())
    workers: list[HostCopyOffloadingWorker] = []
    original_get_worker = HostCopyOffloadingSpec.get_worker

    def recording_get_worker(self, kv_caches):
        worker = original_get_worker(self, kv_caches)
        workers.append(worker)
        return worker

    HostCopyOffloadingSpec.get_worker = recording_get_worker

    def make_llm(offload: bool) -> LLM:
        kwargs = dict(
            model=str(model),
            dtype="float32",
            max_model_len=512,
            block_size=BLOCK_SIZE,
            max_num_seqs=4,
            enable_prefix_caching=True,
            disable_hybrid_kv_cache_manager=False,
            attention_config={"backend": "TRITON_ATTN"},
            enforce_eager=True,
            disable_log_stats=False,
            seed=0,
            # The KV cache report of the GPU tests (run_round_trip calls it).
            worker_extension_cls=KV_CACHE_INSPECTION,
        )
        if offload:
            kwargs["kv_transfer_config"] = offload_transfer_config(
                None,
                cpu_bytes=HOST_BYTES,
                spec_name=HostCopyOffloadingSpec.__name__,
                spec_module_path=HostCopyOffloadingSpec.__module__,
            )
        return LLM(**kwargs)

    prompts = prompt_token_ids(1, BLOCK_SIZE, BLOCK_SIZE, full_blocks=FULL_BLOCKS)
    packed = PackedKVCache(
        backend="TRITON_ATTN",
        layer_types=tuple(model_config["layer_types"]),
        num_kv_heads=model_config["num_key_value_heads"],
        head_size=model_config["head_dim"],
        block_size=BLOCK_SIZE,
        dtype_bytes=4,  # float32
    )
    trip = run_round_trip(
        make_llm,
        prompts,
        MAX_TOKENS,
        filler_tokens=FILLER_TOKENS,
        packed=packed,
    )
    print(f"cold {[g.token_ids for g in trip.cold]}")
    print(f"hit {[(g.num_cached_tokens, g.token_ids) for g in trip.hit]}")
    print(f"reloaded {[(g.num_cached_tokens, g.token_ids) for g in trip.reloaded]}")
    print(f"store bytes {trip.store_bytes:.0f}, load bytes {trip.load_bytes:.0f}")
    (report,) = trip.offload_kv_caches
    print(f"packed KV cache ({report['layout']}): {report['tensors']}")
    trip.check()

    # The connector registered the packed cache: one canonical tensor of block
    # rows, each holding a page of every group side by side.
    (worker,) = workers
    assert len(worker.device_rows) == 1, "the KV cache was not packed"
    assert len(worker.group_data_refs) == 2
    print("all checks passed")


if __name__ == "__main__":
    _run_case(Path(sys.argv[1]))
