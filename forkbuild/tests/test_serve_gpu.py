"""`forkbuild serve --preset offload-47054` on a GPU: concurrent greedy completions with
KV blocks evicted to CPU and reloaded, next to a server without offloading.
Runs in the nightly GPU job (.ci/gpu-nightly); skipped elsewhere.

With random weights a greedy token can flip when the batch around a request changes, and
8 concurrent requests are batched differently by the two servers (eviction, reloads). So the
texts are compared only for one request sent alone to each server while it is cold; the
concurrent rounds must answer every request in full, the offload server must have stored and
loaded KV bytes, and neither log may show an error."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest

from forkbuild import preflight
from forkbuild.pins import REPO_ROOT


def _compute_capability() -> float:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
        capture_output=True, text=True, check=False,
    ).stdout.split()
    return float(out[0]) if out else 0.0


pytestmark = [
    pytest.mark.skipif(not preflight.has_nvidia_gpu(), reason="needs an NVIDIA GPU"),
    pytest.mark.skipif(
        preflight.has_nvidia_gpu() and _compute_capability() < 9.0,
        reason="the preset's FLASH_ATTN serves GPT-OSS only with FA3 (Hopper or newer)",
    ),
]

# A small GPU cache, many distinct long prompts, two rounds: the first round's blocks are
# evicted from the GPU and the second round must reload them from CPU.
# vLLM 0.25.1 refuses to start unless one request of --max-model-len fits in the override:
# get_kv_cache_configs (vllm/v1/core/kv_cache_utils.py) sets the available memory to
# override * _pool_bytes_per_block (2 layers per group x one page) and
# _check_enough_kv_cache_memory compares it with _max_memory_usage_bytes_from_groups
# = 2 x page x (blocks of the full group + blocks of the sliding group). Block size 16:
#   full:    FullAttentionSpec, cdiv(1024, 16) = 64
#   sliding: SlidingWindowSpec.max_admission_blocks_per_request,
#            cdiv(min(128 - 1 + max_num_batched_tokens, 1024), 16) + 1 = 65
#            (every 0.25.1 default max_num_batched_tokens is >= 2048, so the cap is 1024)
# so the override must be >= 64 + 65 = 129 (96 stops both servers at start-up); we take it.
# A prompt is 758-799 tokens: ~48 blocks of the full group alone, so 16 prompts need ~770
# blocks and round 2 must reload most of round 1 from CPU.
# test_serve_gpu_config.py runs these arguments through the same check on CPU.
GPU_BLOCKS = 129
# --block-size 16 is what FLASH_ATTN picks on CUDA anyway; explicit, the CPU check plans the
# same blocks (the CPU platform would pick 128). Both servers use the preset's backend, so
# the cold texts come from the same kernels.
ENGINE_ARGS = ["--num-gpu-blocks-override", str(GPU_BLOCKS), "--block-size", "16",
               "--max-model-len", "1024", "--gpu-memory-utilization", "0.3",
               "--max-num-seqs", "8", "--attention-backend", "FLASH_ATTN"]
OFFLOAD_ARGS = ["--preset", "offload-47054", "--cpu-bytes", str(2 << 30)]
# Both servers serve the embedded tiny GPT-OSS (the #47054 model), not the default chat model.
MODEL_ARGS = ["--model", "tiny-gpt-oss"]
PROMPTS = [
    f"Request {i}: "
    + " ".join(f"key and value block {i}.{j} goes to CPU memory" for j in range(40))
    for i in range(16)
]
MAX_TOKENS = 16
ERRORS = re.compile(r"Traceback|illegal memory access|CUDA error|\bERROR\b")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def _server(extra: list[str], log_path: Path) -> Iterator[tuple[int, subprocess.Popen]]:
    port = _free_port()
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "forkbuild", "serve", "--route", "cuda", "--port", str(port),
             *MODEL_ARGS, *extra, "--", *ENGINE_ARGS],
            cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            # Unbuffered, so that the log read before shutdown holds everything so far.
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            deadline = time.monotonic() + 600
            while True:
                assert server.poll() is None, log_path.read_text()[-3000:]
                assert time.monotonic() < deadline, "server not healthy after 600 s"
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                        break
                except OSError:
                    time.sleep(2)
            yield port, server
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()


def _complete(port: int, prompt: str) -> dict:
    body = json.dumps({"model": "tiny-gpt-oss", "prompt": prompt, "max_tokens": MAX_TOKENS,
                       "temperature": 0, "ignore_eos": True}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", data=body,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as resp:
        return json.load(resp)


def _two_rounds(port: int) -> list[dict]:
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda p: _complete(port, p), PROMPTS))  # stores to CPU
        answers += list(pool.map(lambda p: _complete(port, p), PROMPTS))  # reloads evicted blocks
    return answers


def _counter(metrics: str, name: str) -> float:
    # prometheus_client exposes a Counter named N as N_total; sum over its label sets.
    pattern = rf"^{re.escape(name)}_total(?:\{{[^}}]*\}})? (\S+)$"
    return sum(float(value) for value in re.findall(pattern, metrics, re.MULTILINE))


def _offload_bytes(port: int) -> tuple[float, float]:
    """(loaded, stored) bytes from /metrics; waits briefly, as the last stores finish after
    the last answer."""
    deadline = time.monotonic() + 60
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            metrics = resp.read().decode()
        loaded = _counter(metrics, "vllm:kv_offload_load_bytes")
        stored = _counter(metrics, "vllm:kv_offload_store_bytes")
        if (loaded > 0 and stored > 0) or time.monotonic() > deadline:
            return loaded, stored
        time.sleep(2)


def _serve(
    extra: list[str], log_path: Path, offload: bool
) -> tuple[str, list[dict], tuple[float, float]]:
    with _server(extra, log_path) as (port, server):
        alone = _complete(port, PROMPTS[0])["choices"][0]["text"]  # cold, nothing else in flight
        answers = _two_rounds(port)
        moved = _offload_bytes(port) if offload else (0.0, 0.0)
        assert server.poll() is None, f"server died: {log_path.read_text()[-3000:]}"
        # Read before shutdown: what a stopping server logs is not under test.
        errors = [line for line in log_path.read_text().splitlines() if ERRORS.search(line)]
    assert not errors, "\n".join(errors[:20])
    return alone, answers, moved


def test_offload_preset_serves_and_reloads(tmp_path):
    plain_alone, plain, _ = _serve([], tmp_path / "plain.log", offload=False)
    offload_alone, offload, (loaded, stored) = _serve(
        OFFLOAD_ARGS, tmp_path / "offload.log", offload=True
    )
    for answers in (plain, offload):
        assert len(answers) == 2 * len(PROMPTS)
        for answer in answers:
            assert answer["usage"]["completion_tokens"] == MAX_TOKENS, answer
            assert answer["choices"][0]["finish_reason"] == "length", answer
    assert stored > 0 and loaded > 0, f"stored {stored} B, loaded {loaded} B from CPU"
    assert offload_alone == plain_alone
