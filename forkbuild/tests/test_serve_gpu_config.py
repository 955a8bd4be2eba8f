"""test_serve_gpu.py's engine arguments through vLLM's parser, config and start-up KV
cache check, on CPU: an argument vLLM rejects, or a --num-gpu-blocks-override too small
for one request of --max-model-len, fails here, not in the nightly GPU job. Also the
helper that waits for every process of one server before the next starts."""

import argparse
import os
import signal
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path

import pytest

from forkbuild.serve import server as serve
from forkbuild.tests import test_serve_gpu
from forkbuild.tests.test_serve_gpu import ENGINE_ARGS, GPU_BLOCKS, MODEL_ARGS
from tests.v1.worker.offload_round_trip import KV_CACHE_INSPECTION, KVCacheInspection
from tests.v1.worker.test_packed_kv_cache_pipeline import layer_specs
from tests.v1.worker.tiny_hybrid_model import make_tiny_gpt_oss
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.openai.cli_args import make_arg_parser
from vllm.usage.usage_lib import UsageContext
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.utils.import_utils import resolve_obj_by_qualname
from vllm.v1.core import kv_cache_utils
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

SERVERS = {"plain": [], "offload": test_serve_gpu.OFFLOAD_ARGS}
# What the memory profiler would report; with an override vLLM plans that instead.
PROFILED_BYTES = 8 << 30
# `vllm serve`'s default max_num_batched_tokens on H100/H200 (get_batch_defaults).
HOPPER_SERVE_BATCHED_TOKENS = 8192
REFUSED = "To serve at least one request with the model's max seq len"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_gpt_oss(tmp_path_factory.mktemp("models") / MODEL_ARGS[1])


def _engine_config(model: Path, server: list[str], blocks: int) -> VllmConfig:
    """The config `vllm serve` builds from the command forkbuild serve runs in the GPU
    test, with BLOCKS for its --num-gpu-blocks-override."""
    engine_args = [*ENGINE_ARGS, "--num-gpu-blocks-override", str(blocks)]  # last wins
    fork_parser = argparse.ArgumentParser()
    serve.add_arguments(fork_parser)
    fork_args = fork_parser.parse_args([*MODEL_ARGS, *server, "--", *engine_args])
    assert fork_args.model in serve.EMBEDDED  # generated, and served under its name
    # [vllm, "serve", model, ...], with the embedded model's and the preset's arguments
    argv = serve.command(Path(sys.executable), str(model), fork_args, fork_args.model)
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[2:])
    args.model = args.model_tag  # as the serve subcommand does
    engine = AsyncEngineArgs.from_cli_args(args)
    return engine.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)


def _plan(config: VllmConfig):
    """The engine's start-up planning (EngineCore._initialize_kv_caches): the override
    is applied inside get_kv_cache_configs, before its one-request-fits check."""
    with set_current_vllm_config(config):
        (kv_cache_config,) = kv_cache_utils.get_kv_cache_configs(
            config, [layer_specs(config)], [PROFILED_BYTES]
        )
    return kv_cache_config


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)


@pytest.mark.parametrize("server", SERVERS)
def test_serve_gpu_args_pass_the_startup_check(server, tiny_model, offline):
    config = _engine_config(tiny_model, SERVERS[server], GPU_BLOCKS)
    # The GPU's values, not this CPU platform's: block size 16, both KV cache groups.
    assert config.cache_config.block_size == 16
    assert config.cache_config.num_gpu_blocks_override == GPU_BLOCKS
    assert config.model_config.max_model_len == 1024
    assert config.scheduler_config.disable_hybrid_kv_cache_manager is False
    assert config.attention_config.backend.name == "FLASH_ATTN"
    assert (config.kv_transfer_config is not None) == (server == "offload")
    # The worker extension the test's KV cache report needs, importable by that name.
    assert config.parallel_config.worker_extension_cls == KV_CACHE_INSPECTION
    assert resolve_obj_by_qualname(KV_CACHE_INSPECTION) is KVCacheInspection

    kv_cache_config = _plan(config)
    assert kv_cache_config.num_blocks == GPU_BLOCKS
    groups = kv_cache_config.kv_cache_groups
    specs = [group.kv_cache_spec for group in groups]
    kinds = sorted(type(spec).__name__ for spec in specs)
    assert kinds == [FullAttentionSpec.__name__, SlidingWindowSpec.__name__]
    packed = kv_cache_utils._use_packed_kv_cache_config(config, groups)
    assert packed == (server == "offload")
    # The sliding group's need is capped by max_model_len, so this platform's default
    # max_num_batched_tokens plans the same blocks as a Hopper GPU's.
    (sliding,) = [spec for spec in specs if isinstance(spec, SlidingWindowSpec)]
    need = sliding.max_admission_blocks_per_request
    here = config.scheduler_config.max_num_batched_tokens
    batched = (here, HOPPER_SERVE_BATCHED_TOKENS)
    assert {need(max_num_batched_tokens=t, max_model_len=1024) for t in batched} == {65}


# 96: the old value; GPU_BLOCKS - 1: the check is tight at 64 + 65 blocks.
@pytest.mark.parametrize("blocks", [96, GPU_BLOCKS - 1])
@pytest.mark.parametrize("server", SERVERS)
def test_too_few_gpu_blocks_are_refused(server, blocks, tiny_model, offline):
    config = _engine_config(tiny_model, SERVERS[server], blocks)
    assert config.cache_config.num_gpu_blocks_override == blocks
    with pytest.raises(ValueError, match=REFUSED):
        _plan(config)


# A server in miniature: a shell that starts a child, prints its pid and waits (with
# ignore_term: both ignore SIGTERM, as a stuck engine core would).
SERVER = "sleep 300 & echo $!; wait"


@pytest.fixture
def start_tree():
    """Start the parent in a session of its own, as serving starts a server; return it
    and its child's pid. What a test started is killed at its end whatever happened."""
    started: list[subprocess.Popen] = []

    def start(ignore_term: bool = False) -> tuple[subprocess.Popen, int]:
        script = ("trap '' TERM; " if ignore_term else "") + SERVER
        into = {"stdout": subprocess.PIPE, "start_new_session": True}
        parent = subprocess.Popen(["sh", "-c", script], **into)
        started.append(parent)
        return parent, int(parent.stdout.readline())

    yield start
    for parent in started:
        with suppress(ProcessLookupError):
            os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()
        parent.stdout.close()


def test_stop_session_waits_for_the_servers_children(start_tree):
    parent, child = start_tree()
    # The parent alone gone: its child still runs (as an engine core may after its API
    # server), so waiting for the parent's pid is not waiting for the server.
    os.kill(parent.pid, signal.SIGTERM)
    parent.wait(timeout=30)
    # the child alone runs (session_table counts no zombie)
    assert [pid for pid, *_ in test_serve_gpu.session_table(parent.pid)] == [child]

    test_serve_gpu.stop_session(parent, stop_s=30, kill_s=10)
    assert test_serve_gpu.session_table(parent.pid) == []


def test_stop_session_kills_what_ignores_sigterm(start_tree):
    parent, child = start_tree(ignore_term=True)
    started = time.monotonic()
    test_serve_gpu.stop_session(parent, stop_s=2, kill_s=10)
    assert time.monotonic() - started >= 2  # SIGTERM did not end the child
    assert parent.poll() is not None
    assert test_serve_gpu.session_table(parent.pid) == []


def test_stop_session_fails_naming_what_is_left(start_tree, monkeypatch):
    parent, child = start_tree()
    # Processes no signal ends (e.g. stuck in the GPU driver), simulated: none is sent.
    monkeypatch.setattr(test_serve_gpu, "_signal_session", lambda session, sig: None)
    with pytest.raises(AssertionError) as failure:
        test_serve_gpu.stop_session(parent, stop_s=0.5, kill_s=0.5)
    message = str(failure.value)
    assert f"session {parent.pid}" in message and "after SIGKILL" in message
    assert f"{parent.pid} sh -c" in message and f"{child} sleep 300" in message
