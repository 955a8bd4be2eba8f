"""Offload throughput and CPU-hit TTFT on a GPU, packed cross-layer vs per-layer blocks.

For each layout the OffloadingConnector engine prefills a batch of long prompts (stores
to CPU), the GPU prefix cache is emptied, and the batch runs again (loads from CPU).
Store/load GB/s come from the connector's own counters; TTFT is the batch's latest
first-token latency (vLLM's per-request metric, from arrival), cold vs CPU hit. The
practical PCIe limit is measured alongside: a torch pinned-memory H2D/D2H copy of the
same number of bytes.

Run inside the fork's tree on a GPU host:
    cd build/vllm-0.25.1 && PYTHONPATH=. ../venv/bin/python \\
        ../../benchmarks/offload_throughput_gpu.py \\
        --out result.json [--model DIR_OR_NAME]

It exits non-zero when a figure is zero or missing (offload_figures.py): the report is
still written, for the diagnosis.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

# Beside this file: Python puts a script's folder first on sys.path.
from offload_figures import missing_figures

from tests.v1.worker.offload_round_trip import (
    counter,
    empty_gpu_prefix_cache,
    release_engine,
)
from tests.v1.worker.tiny_hybrid_model import make_tiny_gpt_oss
from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig
from vllm.inputs import TokensPrompt

PROMPTS = [[(13 * i + j) % 300 + 10 for j in range(2000)] for i in range(8)]
# A short request decoding beside each batch. LLMEngine records scheduler stats (the
# connector's counters) only on steps with request outputs; one-token requests have none
# in the step that submits their deferred stores, nor while they wait for a load. The
# filler keeps every step recording until the transfers are done.
FILLER = [11] * 4
FILLER_TOKENS = 256


def timed_batch(llm: LLM, prompts) -> float:
    """Batch TTFT: the latest first-token latency of PROMPTS, run beside the filler;
    the filler's own decode steps do not count."""
    params = [SamplingParams(max_tokens=FILLER_TOKENS, ignore_eos=True)]
    params += [SamplingParams(max_tokens=1)] * len(prompts)
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in [FILLER, *prompts]],
        params,
        use_tqdm=False,
    )
    return max(o.metrics.first_token_latency for o in outputs[1:])


def measure(model: str, cross_layer: bool, enforce_eager: bool = False) -> dict:
    llm = LLM(
        model=model,
        enforce_eager=enforce_eager,
        dtype="bfloat16",
        max_model_len=4096,
        gpu_memory_utilization=0.4,
        enable_prefix_caching=True,
        disable_hybrid_kv_cache_manager=False,
        disable_log_stats=False,
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "spec_name": "CPUOffloadingSpec",
                "enable_cross_layers_blocks": str(cross_layer),
                "cpu_bytes_to_use": 8 << 30,
            },
        ),
    )
    names = ("store_bytes", "store_time", "load_bytes", "load_time")
    before = {k: counter(f"vllm:kv_offload_{k}") for k in names}
    cold_s = timed_batch(llm, PROMPTS)
    empty_gpu_prefix_cache(llm)
    hit_s = timed_batch(llm, PROMPTS)
    delta = {k: counter(f"vllm:kv_offload_{k}") - v for k, v in before.items()}
    release_engine(llm)
    del llm
    return {
        "layout": "cross-layer (packed)" if cross_layer else "per-layer",
        "store_bytes": delta["store_bytes"],
        "load_bytes": delta["load_bytes"],
        "store_GBps": delta["store_bytes"] / delta["store_time"] / 1e9
        if delta["store_time"]
        else None,
        "load_GBps": delta["load_bytes"] / delta["load_time"] / 1e9
        if delta["load_time"]
        else None,
        "ttft_cold_batch_s": cold_s,
        "ttft_cpu_hit_batch_s": hit_s,
    }


def pinned_copy(num_bytes: int, repeats: int = 5) -> dict:
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    result = {}
    for name, dst, src in (("h2d", device, host), ("d2h", host, device)):
        start, end = (
            torch.cuda.Event(enable_timing=True),
            torch.cuda.Event(enable_timing=True),
        )
        dst.copy_(src, non_blocking=True)  # warm-up
        start.record()
        for _ in range(repeats):
            dst.copy_(src, non_blocking=True)
        end.record()
        torch.cuda.synchronize()
        result[f"{name}_GBps"] = (
            num_bytes * repeats / (start.elapsed_time(end) / 1e3) / 1e9
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", help="default: a tiny GPT-OSS generated locally")
    # The GPU bundle's run: no compile or CUDA-graph capture in its few minutes. The
    # connector's GB/s do not depend on it; the TTFTs are eager ones (the report says).
    parser.add_argument("--enforce-eager", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("offload_throughput_gpu: needs a CUDA GPU")
    model = args.model or str(make_tiny_gpt_oss(Path(args.out).parent / "tiny-gpt-oss"))
    eager = args.enforce_eager
    runs = [measure(model, True, eager), measure(model, False, eager)]
    report = {
        "gpu": torch.cuda.get_device_name(),
        "model": model,
        "enforce_eager": eager,
        "runs": runs,
        "pinned_copy": pinned_copy(int(max(r["store_bytes"] for r in runs)) or 1 << 28),
    }
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    missing = missing_figures(report)
    if missing:
        raise SystemExit(
            "offload_throughput_gpu: these figures are zero or missing, so nothing was "
            "measured for them: " + "; ".join(missing) + ". The report is in "
            f"{args.out}; check that the engine stored to and loaded from CPU (the "
            "connector's vllm:kv_offload_* counters)"
        )


if __name__ == "__main__":
    main()
