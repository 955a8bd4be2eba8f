"""`forkbuild serve --preset offload-47054` on a GPU: concurrent greedy completions with
KV blocks evicted to CPU and reloaded, identical to a server without offloading.
Runs in the nightly GPU job (.ci/gpu-nightly); skipped elsewhere."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

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

# Small GPU cache, many distinct long prompts, two rounds: the first round's blocks are
# evicted from the GPU and the second round must reload them from CPU.
ENGINE_ARGS = ["--num-gpu-blocks-override", "96", "--max-model-len", "1024",
               "--gpu-memory-utilization", "0.3", "--max-num-seqs", "8"]
PROMPTS = [
    f"Request {i}: " + " ".join(f"key and value block {i}.{j} goes to CPU memory" for j in range(40))
    for i in range(16)
]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve_and_complete(extra: list[str], log_path) -> list[str]:
    port = _free_port()
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "forkbuild", "serve", "--route", "cuda", "--port", str(port),
             *extra, "--", *ENGINE_ARGS],
            cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 600
            while True:
                assert server.poll() is None, open(log_path).read()[-3000:]
                assert time.monotonic() < deadline, "server not healthy after 600 s"
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                        break
                except OSError:
                    time.sleep(2)

            def complete(prompt: str) -> str:
                body = json.dumps({"model": "tiny-gpt-oss", "prompt": prompt, "max_tokens": 16,
                                   "temperature": 0, "ignore_eos": True}).encode()
                request = urllib.request.Request(
                    f"http://127.0.0.1:{port}/v1/completions", data=body,
                    headers={"Content-Type": "application/json"},
                )
                with urllib.request.urlopen(request, timeout=300) as resp:
                    return json.load(resp)["choices"][0]["text"]

            with ThreadPoolExecutor(8) as pool:
                answers = list(pool.map(complete, PROMPTS))  # stores to CPU
                answers += list(pool.map(complete, PROMPTS))  # reloads evicted blocks
            return answers
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=120)


def test_offload_preset_serves_same_answers(tmp_path):
    plain = _serve_and_complete([], tmp_path / "plain.log")
    offload = _serve_and_complete(
        ["--preset", "offload-47054", "--cpu-bytes", str(2 << 30)], tmp_path / "offload.log"
    )
    log = (tmp_path / "offload.log").read_text()
    assert "Traceback" not in log and "illegal memory access" not in log
    assert offload == plain
