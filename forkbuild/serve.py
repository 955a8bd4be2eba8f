"""`vllm serve` through the fork.

Without --model it serves the embedded tiny GPT-OSS (generated locally, no network).
--preset offload-47054 adds the configuration of vLLM issue #47054: cross-layer CPU KV
offloading on FlashAttention, with prefix caching and the hybrid KV cache manager on.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path

from forkbuild import log, preflight
from forkbuild.errors import ForkError
from forkbuild.pins import Pins, build_dir

EMBEDDED_NAME = "tiny-gpt-oss"
DEFAULT_CPU_BYTES = 8 * 2**30


def offload_47054_args(cpu_bytes: int) -> list[str]:
    """The #47054 configuration, as the report ran it (minus its model and TP size)."""
    kv_transfer = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "CPUOffloadingSpec",
            "enable_cross_layers_blocks": "True",
            "cpu_bytes_to_use": cpu_bytes,
            "eviction_policy": "lru",
        },
    }
    return [
        "--kv-transfer-config", json.dumps(kv_transfer),
        "--enable-prefix-caching",
        "--no-disable-hybrid-kv-cache-manager",
        "--attention-backend", "FLASH_ATTN",
    ]


PRESETS = {"offload-47054": offload_47054_args}


def add_arguments(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument("--model", help="model name or path (default: the embedded tiny GPT-OSS)")
    cmd.add_argument("--preset", choices=sorted(PRESETS), help="a documented vLLM configuration")
    cmd.add_argument("--host", default="127.0.0.1")
    cmd.add_argument("--port", type=int, default=8000)
    cmd.add_argument("--cpu-bytes", type=int, default=DEFAULT_CPU_BYTES,
                     help="CPU memory for offloaded KV blocks, with --preset offload-47054")
    cmd.add_argument("vllm_args", nargs=argparse.REMAINDER,
                     help="after --: passed to vllm serve unchanged")


# The generator lives with the fork's tests (the CPU engine test uses it too).
GENERATOR = "tests/v1/worker/tiny_hybrid_model.py"


def ensure_tiny_model(python: Path, tree_path: Path) -> Path:
    out = build_dir() / "models" / EMBEDDED_NAME
    log.step(f"serve: preparing the embedded model in {out}")
    result = subprocess.run(
        [str(python), str(tree_path / GENERATOR), str(out)],
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True, text=True, check=False,
    )
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise ForkError(f"could not generate the embedded model: {last}")
    return out


def command(python: Path, model: str, args: argparse.Namespace, embedded: bool) -> list[str]:
    cmd = [str(python.parent / "vllm"), "serve", model, "--host", args.host, "--port", str(args.port)]
    if embedded:
        cmd += ["--served-model-name", EMBEDDED_NAME, "--max-model-len", "1024", "--dtype", "bfloat16"]
    if args.preset:
        cmd += PRESETS[args.preset](args.cpu_bytes)
    extra = list(args.vllm_args)
    if extra[:1] == ["--"]:
        extra = extra[1:]
    return cmd + extra


def serve(pins: Pins, args: argparse.Namespace) -> None:
    # Everything that can be refused is refused before minutes of install and start-up.
    gpu = preflight.has_nvidia_gpu()
    if args.preset and not gpu:
        raise ForkError(
            f"--preset {args.preset} needs an NVIDIA GPU, and this machine has none "
            "(vLLM 0.25.1 offloads KV blocks to CPU only from CUDA-alike or XPU GPUs)",
            "run it on a GPU host, or serve without --preset",
        )
    if args.route == "cuda" and not gpu:
        raise ForkError("--route cuda needs an NVIDIA GPU, and this machine has none", "use --route cpu")
    preflight.check_port_free(args.host, args.port)

    from forkbuild import install

    python, tree_path, route = install.install(pins, args.route)
    embedded = args.model is None
    model = str(ensure_tiny_model(python, tree_path)) if embedded else args.model
    env = dict(os.environ)
    if embedded:
        env["HF_HUB_OFFLINE"] = "1"
    if route.target_device == "cpu":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB; vLLM's default is sized for big hosts
    preflight.check_port_free(args.host, args.port)
    cmd = command(python, model, args, embedded)
    log.step(f"serve: {' '.join(cmd)}")
    log.step(f"serve: try  curl http://{args.host}:{args.port}/v1/completions -H 'Content-Type: application/json' "
             f"-d '{{\"model\": \"{EMBEDDED_NAME if embedded else model}\", \"prompt\": \"Hello\", \"max_tokens\": 8}}'")
    os.execve(cmd[0], cmd, env)
