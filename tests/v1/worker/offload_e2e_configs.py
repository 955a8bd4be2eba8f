# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Engine configurations of the GPU end-to-end tests for vllm#47054.

Kept in one place so that a CPU-only test can build every one of them through
vLLM's own config classes: a misspelled argument or connector option then
fails in CPU CI, not on the GPU runner at night.
"""

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from vllm.config import KVTransferConfig

GPU_BLOCK_SIZE = 16
CPU_BYTES = 1 << 30
SLIDING_WINDOW = 128  # the tiny GPT-OSS's (tiny_hybrid_model.py)
NUM_PROMPTS = 4
MAX_TOKENS = 16
# Decode steps of the filler request that keeps every step recorded while a prompt
# reloads (offload_round_trip.py): many more than a load of a few blocks takes.
FILLER_TOKENS = 64


def full_blocks(offloaded_block_size: int) -> int:
    """Offloaded blocks per prompt: a window's worth, so that prompts (a tail
    longer) reach past the sliding window and it matters."""
    return max(1, SLIDING_WINDOW // offloaded_block_size)


@dataclass(frozen=True)
class OffloadCase:
    """One engine configuration of the #47054 setup."""

    attn_backend: str  # "FLASH_ATTN" or "TRITON_ATTN": same cache shape and HND order
    model_runner: str  # "v1" (GPT-OSS's default) or "v2"
    cpu_block_size: int | None = None  # None: offloaded blocks are GPU blocks
    tensor_parallel_size: int = 1
    # (query heads, KV heads) of the generated tiny GPT-OSS; None: its default
    # (4, 2). A rank must keep at least 2 KV heads: with one, a page's HND and
    # NHD orders are the same bytes and a head/token order defect cannot show.
    tiny_model_heads: tuple[int, int] | None = None

    @property
    def id(self) -> str:
        cpu = f"-cpu{self.cpu_block_size}" if self.cpu_block_size else ""
        tp = self.tensor_parallel_size
        return f"{self.attn_backend}-{self.model_runner}{cpu}-tp{tp}"


CASES = [
    OffloadCase("FLASH_ATTN", "v1"),
    OffloadCase("FLASH_ATTN", "v2"),
    OffloadCase("FLASH_ATTN", "v1", cpu_block_size=4 * GPU_BLOCK_SIZE),
    OffloadCase("TRITON_ATTN", "v1"),
    # 4 KV heads over 2 ranks: 2 per rank. Only this case pays for the larger
    # model (the CPU tests build its config too).
    OffloadCase("FLASH_ATTN", "v1", tensor_parallel_size=2, tiny_model_heads=(8, 4)),
]


def tiny_model(case: OffloadCase, folder: Path) -> Path:
    """The generated tiny GPT-OSS of CASE in FOLDER (one per head count): made
    there unless FOLDER already holds it."""
    from tests.v1.worker.tiny_hybrid_model import make_tiny_gpt_oss

    if case.tiny_model_heads is None:
        return make_tiny_gpt_oss(folder / "tiny-gpt-oss")
    q, kv = case.tiny_model_heads
    return make_tiny_gpt_oss(folder / f"tiny-gpt-oss-q{q}-kv{kv}", q, kv)


def offload_transfer_config(
    cpu_block_size: int | None,
    *,
    cpu_bytes: int = CPU_BYTES,
    spec_name: str = "CPUOffloadingSpec",
    spec_module_path: str | None = None,
    cross_layers_blocks: bool = True,
) -> KVTransferConfig:
    """The connector configuration of the original report. SPEC_MODULE_PATH names
    a module holding SPEC_NAME: the connector's extension point for specs.
    CROSS_LAYERS_BLOCKS False leaves ``enable_cross_layers_blocks`` out: each
    layer's pages are offloaded apart (the per-layer path)."""
    extra = {
        "spec_name": spec_name,
        "cpu_bytes_to_use": cpu_bytes,
        "eviction_policy": "lru",
    }
    if cross_layers_blocks:
        extra["enable_cross_layers_blocks"] = "True"
    if spec_module_path is not None:
        extra["spec_module_path"] = spec_module_path
    if cpu_block_size is not None:
        extra["block_size"] = cpu_block_size
    return KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config=extra,
    )


def engine_kwargs(
    case: OffloadCase, model: str, *, offload: bool, worker_extension_cls: str = ""
) -> dict:
    """Keyword arguments for ``LLM``/``EngineArgs``: the baseline (offload=False)
    differs from the #47054 engine only by the connector. WORKER_EXTENSION_CLS
    (vLLM's hook for methods that ``collective_rpc`` can call by name) adds
    methods to the worker and changes nothing else."""
    kwargs = dict(
        model=model,
        dtype="bfloat16",
        max_model_len=1024,
        block_size=GPU_BLOCK_SIZE,
        gpu_memory_utilization=0.3,
        enable_prefix_caching=True,
        disable_hybrid_kv_cache_manager=False,
        tensor_parallel_size=case.tensor_parallel_size,
        attention_config={"backend": case.attn_backend},
        disable_log_stats=False,
        seed=0,
        worker_extension_cls=worker_extension_cls,
    )
    if offload:
        kwargs["kv_transfer_config"] = offload_transfer_config(case.cpu_block_size)
    return kwargs


def runner_env(case: OffloadCase) -> dict[str, str]:
    return {"VLLM_USE_V2_MODEL_RUNNER": "1" if case.model_runner == "v2" else "0"}


def offloading_spec_inputs(vllm_config, kv_cache_config) -> tuple:
    """The arguments an OffloadingSpec (and OffloadingSpecFactory.create_spec) takes,
    built as the connector builds them: from vLLM 0.26 one OffloadingConfig, before
    that the engine's two configs."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
            build_offloading_config,
        )
    except ImportError:
        return (vllm_config, kv_cache_config)
    return (build_offloading_config(vllm_config, kv_cache_config),)


def tiny_gpt_oss_config(path, head_size: int, num_kv_heads: int) -> str:
    """A GPT-OSS config written to PATH, with no weights: all the planner needs is the
    shapes (4 layers, sliding-window and full attention alternating)."""
    config = {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "hidden_size": 256,
        "intermediate_size": 256,
        "head_dim": head_size,
        "num_attention_heads": 8,
        "num_key_value_heads": num_kv_heads,
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "sliding_window": SLIDING_WINDOW,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "vocab_size": 400,
        "max_position_embeddings": 4096,
        "dtype": "bfloat16",
        "rope_parameters": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 4096,
            "rope_theta": 150000.0,
            "truncate": False,
        },
    }
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


if __name__ == "__main__":
    # python -m tests.v1.worker.offload_e2e_configs FOLDER: every case's tiny model,
    # made ahead (the GPU bundle carries them to hosts that run the cases offline).
    for made in sorted({tiny_model(case, Path(sys.argv[1])) for case in CASES}):
        print(made)


def offline_harness_model(harness, folder: Path, monkeypatch) -> str:
    """A local tiny GPT-OSS (config and tokenizer, no weights) in FOLDER, made the
    model of upstream's connector harness (HARNESS: its offloading_connector utils),
    which names a hub id; the scheduler never loads weights, so tests run offline."""
    from transformers import PreTrainedTokenizerFast

    from tests.v1.worker.tiny_hybrid_model import byte_level_bpe

    folder.mkdir()
    tiny_gpt_oss_config(folder, head_size=64, num_kv_heads=2)
    # The scheduler's structured output manager loads the model's tokenizer.
    PreTrainedTokenizerFast(
        tokenizer_object=byte_level_bpe(["<|endoftext|>"]), eos_token="<|endoftext|>"
    ).save_pretrained(folder)
    create = harness.create_vllm_config

    def create_offline(*args, **kwargs):
        kwargs["model"] = str(folder)
        # The harness's max_model_len (10000) exceeds the config's positions.
        kwargs["hf_overrides"] = {"max_position_embeddings": 10000}
        return create(*args, **kwargs)

    monkeypatch.setattr(harness, "create_vllm_config", create_offline)
    return str(folder)
