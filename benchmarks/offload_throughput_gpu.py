"""Offload throughput and CPU-hit TTFT on a GPU, packed cross-layer vs per-layer blocks.

For each layout the OffloadingConnector engine prefills a batch of long prompts (stores
to CPU), the GPU prefix cache is emptied, and the batch runs again (loads from CPU).
Store/load GB/s come from the connector's own counters; TTFT is the wall time of a
one-token generation, cold vs CPU hit. The practical PCIe limit is measured alongside:
a torch pinned-memory H2D/D2H copy of the same number of bytes.

Run inside the fork's tree on a GPU host:
    cd build/vllm-0.25.1 && ../venv/bin/python ../../benchmarks/offload_throughput_gpu.py \\
        --out result.json [--model DIR_OR_NAME]
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import prometheus_client
import torch

from tests.v1.worker.tiny_hybrid_model import make_tiny_gpt_oss
from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig
from vllm.distributed import cleanup_dist_env_and_memory
from vllm.inputs import TokensPrompt

PROMPTS = [[(13 * i + j) % 300 + 10 for j in range(2000)] for i in range(8)]


def counter(name: str) -> float:
    return sum(s.value for m in prometheus_client.REGISTRY.collect() if m.name == name
               for s in m.samples if s.name == name + "_total")


def timed_generate(llm: LLM, prompts) -> float:
    start = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                 SamplingParams(max_tokens=1), use_tqdm=False)
    return time.perf_counter() - start


def measure(model: str, cross_layer: bool) -> dict:
    llm = LLM(
        model=model, dtype="bfloat16", max_model_len=4096, gpu_memory_utilization=0.4,
        enable_prefix_caching=True, disable_hybrid_kv_cache_manager=False, disable_log_stats=False,
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both",
            kv_connector_extra_config={"spec_name": "CPUOffloadingSpec",
                                       "enable_cross_layers_blocks": str(cross_layer),
                                       "cpu_bytes_to_use": 8 << 30}),
    )
    before = {k: counter(f"vllm:kv_offload_{k}") for k in
              ("store_bytes", "store_time", "load_bytes", "load_time")}
    cold_s = timed_generate(llm, PROMPTS)
    deadline = time.monotonic() + 120
    while not llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            raise TimeoutError("stores to CPU did not finish")
        timed_generate(llm, [[1]])
    hit_s = timed_generate(llm, PROMPTS)
    delta = {k: counter(f"vllm:kv_offload_{k}") - v for k, v in before.items()}
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()
    return {
        "layout": "cross-layer (packed)" if cross_layer else "per-layer",
        "store_bytes": delta["store_bytes"], "load_bytes": delta["load_bytes"],
        "store_GBps": delta["store_bytes"] / delta["store_time"] / 1e9 if delta["store_time"] else None,
        "load_GBps": delta["load_bytes"] / delta["load_time"] / 1e9 if delta["load_time"] else None,
        "ttft_cold_batch_s": cold_s, "ttft_cpu_hit_batch_s": hit_s,
    }


def pinned_copy(num_bytes: int, repeats: int = 5) -> dict:
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    result = {}
    for name, dst, src in (("h2d", device, host), ("d2h", host, device)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dst.copy_(src, non_blocking=True)  # warm-up
        start.record()
        for _ in range(repeats):
            dst.copy_(src, non_blocking=True)
        end.record()
        torch.cuda.synchronize()
        result[f"{name}_GBps"] = num_bytes * repeats / (start.elapsed_time(end) / 1e3) / 1e9
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", help="default: a tiny GPT-OSS generated locally")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("offload_throughput_gpu: needs a CUDA GPU")
    model = args.model or str(make_tiny_gpt_oss(Path(args.out).parent / "tiny-gpt-oss"))
    runs = [measure(model, cross_layer=True), measure(model, cross_layer=False)]
    report = {
        "gpu": torch.cuda.get_device_name(), "model": model, "runs": runs,
        "pinned_copy": pinned_copy(int(max(r["store_bytes"] for r in runs)) or 1 << 28),
    }
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
