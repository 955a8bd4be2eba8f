"""`forkbuild serve --preset offload-47054` on a GPU next to a server without
offloading (the nightly job, as docs/gpu-nightly.md lists it; skipped elsewhere). Random
weights let a greedy token flip with the batch: texts are compared only for one request
sent alone to each cold server. vLLM 0.25.1 logs nothing when it packs: the workers'
KV cache report (offload_round_trip.py) shows it."""

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
from contextlib import contextmanager, suppress
from pathlib import Path

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from forkbuild.core.pins import REPO_ROOT, build_dir
from tests.v1.worker.offload_round_trip import (
    KV_CACHE_INSPECTION,
    KV_CACHE_REPORT,
    PackedKVCache,
    check_not_packed,
    check_packed,
)


def _compute_capability() -> tuple[int, int]:
    """The weakest compute capability of the visible GPUs (as the nightly counts),
    (0, 0) without nvidia-smi or a GPU."""
    from forkbuild.gpu import required

    query = ["nvidia-smi", f"--query-gpu={required.NVIDIA_SMI_QUERY}", "--format=csv"]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        out = subprocess.run(query, capture_output=True, text=True).stdout
        return min(required.parse_nvidia_smi(out, visible))
    except Exception:  # no GPU, no nvidia-smi or none visible
        return (0, 0)


pytestmark = pytest.mark.skipif(
    _compute_capability() < (9, 0),
    reason="needs an NVIDIA GPU with FA3 (Hopper or newer): the preset's FLASH_ATTN "
    "serves GPT-OSS only with it",
)

# A small GPU cache, 16 distinct prompts of 758-799 tokens (~770 blocks), two rounds:
# round 1's blocks are evicted, round 2 reloads them from CPU. vLLM 0.25.1 starts only
# if one --max-model-len request fits (kv_cache_utils.py): cdiv(1024, 16) = 64 full
# blocks + cdiv(min(127 + batched tokens (>= 2048), 1024), 16) + 1 = 65 sliding ones;
# 96 stops both servers. test_serve_gpu_config.py checks this on CPU.
GPU_BLOCKS = 129
# --block-size 16 is FLASH_ATTN's pick on CUDA; explicit, the CPU check plans the same
# blocks. Both servers use the preset's backend (the cold texts: the same kernels); the
# extension adds the report that VLLM_SERVER_DEV_MODE=1's /collective_rpc calls.
ENGINE_ARGS = [
    *f"--num-gpu-blocks-override {GPU_BLOCKS} --block-size 16 --max-model-len 1024 "
    "--gpu-memory-utilization 0.3 --max-num-seqs 8 --attention-backend FLASH_ATTN "
    "--worker-extension-cls".split(),
    KV_CACHE_INSPECTION,
]
OFFLOAD_ARGS = ["--preset", "offload-47054", "--cpu-bytes", str(2 << 30)]
MODEL_ARGS = ["--model", "tiny-gpt-oss"]  # both servers: the #47054 model, embedded
PROMPTS = [
    f"Request {i}: "
    + " ".join(f"key and value block {i}.{j} goes to CPU memory" for j in range(40))
    for i in range(16)
]
MAX_TOKENS = 16
ERRORS = re.compile(r"Traceback|illegal memory access|CUDA error|\bERROR\b")

# How long the processes of a server may take to exit after SIGTERM, and after SIGKILL.
STOP_S, KILL_S = 120, 30
GONE = (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)


def session_table(session: int) -> list[tuple[int, int, str]]:
    """(pid, group, 'PID COMMAND') of each live process of SESSION; no zombies: they
    hold no memory, and a container's PID 1 may never reap an orphan's."""
    found = []
    for proc in psutil.process_iter(["cmdline", "name", "status"]):
        with suppress(OSError, psutil.Error):  # exited meanwhile
            if os.getsid(proc.pid) == session and proc.info["status"] not in GONE:
                words = " ".join(proc.info["cmdline"] or [f"({proc.info['name']})"])
                described = f"{proc.pid} {' '.join(words.split())[:200]}"
                found.append((proc.pid, os.getpgid(proc.pid), described))
    return found


def _signal_session(session: int, sig: signal.Signals) -> None:
    """SIG once to each process of SESSION: its leader's group, then the others (vLLM's
    API server, engine core and workers take SIGTERM as a shutdown request)."""
    with suppress(ProcessLookupError):
        os.killpg(session, sig)
    for pid, pgrp, _ in session_table(session):
        if pgrp != session:
            with suppress(ProcessLookupError):
                os.kill(pid, sig)


def _wait_session(leader: subprocess.Popen, timeout: float) -> list[str]:
    """Wait up to TIMEOUT seconds for LEADER's session to empty; what is left."""
    deadline = time.monotonic() + timeout
    while True:
        leader.poll()  # reap the leader, our child
        left = [described for *_, described in session_table(leader.pid)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.5)


def stop_session(
    leader: subprocess.Popen, stop_s: float = STOP_S, kill_s: float = KILL_S
) -> None:
    """Stop LEADER's session (start_new_session=True), returning once it is empty:
    engine cores and workers may outlive LEADER holding GPU memory, which fails the next
    server's memory profiling (gpu_worker.py, `init_snapshot.free_memory >= ...`)."""
    _signal_session(leader.pid, signal.SIGTERM)
    if left := _wait_session(leader, stop_s):
        print(f"session {leader.pid}: SIGKILL after {stop_s:.0f} s: {'; '.join(left)}")
        _signal_session(leader.pid, signal.SIGKILL)
        left = _wait_session(leader, kill_s)
    assert not left, (
        f"processes of the server (session {leader.pid}) still running {stop_s:.0f} s "
        f"after SIGTERM and {kill_s:.0f} s after SIGKILL: " + "; ".join(left)
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def serving(
    args: list[str], log_path: Path, limit_s: int, **stop: float
) -> Iterator[tuple[int, subprocess.Popen]]:
    """`forkbuild serve ARGS` on a free port, its output in LOG_PATH, until healthy;
    stopped after (stop_session: it runs in a session of its own)."""
    port = free_port()
    argv = [sys.executable, "-m", "forkbuild", "serve", "--port", str(port), *args]
    # The worker imports the extension (ENGINE_ARGS) from the fork's tests.
    path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "VLLM_SERVER_DEV_MODE": "1"}  # the RPC
    env["PYTHONUNBUFFERED"] = "1"  # the log read before shutdown holds all
    with open(log_path, "w") as log:
        into = {"stdout": log, "stderr": subprocess.STDOUT, "start_new_session": True}
        server = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, **into)
        deadline = time.monotonic() + limit_s
        try:
            while True:
                assert server.poll() is None, (
                    f"server exited: {log_path.read_text()[-3000:]}"
                )
                assert time.monotonic() < deadline, f"not healthy after {limit_s} s"
                with suppress(OSError):
                    urllib.request.urlopen(
                        f"http://127.0.0.1:{port}/health", timeout=5
                    ).close()
                    break
                time.sleep(2)
            yield port, server
        finally:
            stop_session(server, **stop)


def post(url: str, body: dict, timeout: float = 120) -> dict:
    """BODY as JSON to URL; its answer, which must be 200."""
    data = json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    request = urllib.request.Request(url, data=data, headers=headers)
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        assert resp.status == 200
        return json.load(resp)


def _complete(port: int, prompt: str) -> dict:
    body = {"model": "tiny-gpt-oss", "prompt": prompt, "max_tokens": MAX_TOKENS}
    body |= {"temperature": 0, "ignore_eos": True}
    return post(f"http://127.0.0.1:{port}/v1/completions", body, timeout=300)


def _kv_cache_reports(port: int) -> list[dict]:
    """Each worker's kv_cache_report through vLLM 0.25.1's dev-mode endpoint
    (entrypoints/serve/dev/rpc/api_router.py): {"results": [one per worker]}."""
    body = {"method": KV_CACHE_REPORT, "timeout": 60}
    return post(f"http://127.0.0.1:{port}/collective_rpc", body)["results"]


def _packed_kv_cache() -> PackedKVCache:
    """The offload server's packed cache: the embedded tiny GPT-OSS (as forkbuild serve
    generated it) in bfloat16 (serve.command), with ENGINE_ARGS' blocks and backend."""
    config_file = build_dir() / "models" / MODEL_ARGS[1] / "config.json"
    config = json.loads(config_file.read_text())
    heads = {"num_kv_heads": config["num_key_value_heads"]}
    heads["head_size"] = config["head_dim"]
    blocks = {"block_size": 16, "dtype_bytes": 2, "num_blocks": GPU_BLOCKS}
    layers = tuple(config["layer_types"])
    return PackedKVCache(backend="FLASH_ATTN", layer_types=layers, **heads, **blocks)


def _offload_bytes(port: int) -> tuple[float, float]:
    """(loaded, stored) bytes from /metrics; waits for stores after the last answer."""
    deadline = time.monotonic() + 60
    while True:
        url = f"http://127.0.0.1:{port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as resp:
            families = text_string_to_metric_families(resp.read().decode())
        # Each counter's N_total samples, summed over its label sets.
        total = {f.name: sum(s.value for s in f.samples) for f in families}
        loaded = total.get("vllm:kv_offload_load_bytes", 0.0)
        stored = total.get("vllm:kv_offload_store_bytes", 0.0)
        if (loaded > 0 and stored > 0) or time.monotonic() > deadline:
            return loaded, stored
        time.sleep(2)


def _serve(
    extra: list[str], log_path: Path, offload: bool
) -> tuple[str, list[dict], tuple[float, float]]:
    args = ["--route", "cuda", *MODEL_ARGS, *extra, "--", *ENGINE_ARGS]
    with serving(args, log_path, 600) as (port, server):
        # The KV cache under test, before any request (a config that stops packing fails
        # here, not after minutes of a test of per-layer offloading).
        (report,) = _kv_cache_reports(port)  # one worker
        if offload:
            check_packed(report, _packed_kv_cache())
        else:
            check_not_packed(report)
        # cold, nothing else in flight
        alone = _complete(port, PROMPTS[0])["choices"][0]["text"]
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda p: _complete(port, p), PROMPTS))  # stores
            answers += list(pool.map(lambda p: _complete(port, p), PROMPTS))  # reloads
        moved = _offload_bytes(port) if offload else (0.0, 0.0)
        assert server.poll() is None, f"server died: {log_path.read_text()[-3000:]}"
        # Read before shutdown: what a stopping server logs is not under test.
        errors = list(filter(ERRORS.search, log_path.read_text().splitlines()))
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
