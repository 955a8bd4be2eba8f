"""`forkbuild serve` end to end: refusals come at once; the embedded model answers."""

import json
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from forkbuild.core import preflight
from forkbuild.core.errors import ForkError
from forkbuild.core.pins import REPO_ROOT
from forkbuild.serve import server as serve
from forkbuild.tests.test_serve_gpu import _kv_cache_reports, free_port, post, serving
from tests.v1.worker.offload_round_trip import KV_CACHE_INSPECTION, check_not_packed
from vllm.model_executor.models.config import MODELS_CONFIG_MAP
from vllm.reasoning import ReasoningParserManager


def _refused(*args: str) -> str:
    """`forkbuild ARGS` must fail at once (no install, no hub lookup: that took ~32 s)
    in one line, which is returned."""
    start = time.monotonic()
    argv = [sys.executable, "-m", "forkbuild", *args]
    options = {"capture_output": True, "text": True, "timeout": 60, "check": False}
    result = subprocess.run(argv, cwd=REPO_ROOT, **options)
    assert result.returncode == 1
    assert time.monotonic() - start < 20
    (line,) = result.stderr.strip().splitlines()
    return line


@pytest.mark.skipif(
    preflight.has_nvidia_gpu(), reason="checks the refusal on a machine without a GPU"
)
def test_gpu_preset_without_gpu_is_refused_at_once():
    line = _refused(
        "serve", "--preset", "offload-47054", "--model", "openai/gpt-oss-20b"
    )
    assert "needs an NVIDIA GPU" in line


def test_port_in_use_and_a_mistyped_model_are_refused_at_once():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = _refused("serve", "--port", str(port))
    assert f"port {port} on 127.0.0.1 is already in use" in line
    line = _refused("serve", "--model", "tiny-chta", "--port", str(free_port()))
    assert "'tiny-chta' is neither an embedded model" in line
    assert "did you mean tiny-chat?" in line and "org/name" in line


# gpt2: a bare name (the hub's org-less ids redirect to org/name ones); ./tiny-chat: a
# path that does not exist.
NAMES_NOTHING = {"tiny-chta": "tiny-chat", "Tiny-Chat": "tiny-chat", "gpt2": None}
NAMES_NOTHING |= {"tiny-gptoss": "tiny-gpt-oss", "./tiny-chat": "tiny-chat"}


@pytest.mark.parametrize(("model", "close"), NAMES_NOTHING.items())
def test_model_that_names_nothing_is_refused(model, close, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ForkError, match="is neither an embedded model") as err:
        serve.check_model(model)
    assert (f"did you mean {close}?" in str(err.value)) == bool(close)
    assert "org/name" in err.value.hint and "\n" not in str(err.value)
    nothing = "is not a local path that exists, nor a hub id"
    for path in ("/no/such/folder", "models/a/b"):
        with pytest.raises(ForkError, match=nothing):
            serve.check_model(path)


def test_legitimate_models_are_not_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my-model").mkdir()
    (tmp_path / "model.gguf").write_bytes(b"")
    # a bare hub id already downloaded
    (tmp_path / "hub" / "models--gpt2").mkdir(parents=True)
    local = ["my-model", "./my-model", str(tmp_path / "my-model"), "~/my-model"]
    hub = ["openai/gpt-oss-20b", "Qwen/Qwen3-0.6B", "openai-community/gpt2", "gpt2"]
    for model in (None, *serve.EMBEDDED, *local, "model.gguf", *hub):
        serve.check_model(model)


def test_tiny_gpt_oss_gets_no_chat_line_and_the_reason():
    lines = serve.try_lines("127.0.0.1", 8001, "tiny-gpt-oss")
    urls = [line.split()[2] for line in lines if line.startswith("try  curl ")]
    assert urls == ["http://127.0.0.1:8001/v1/completions"]
    (reason,) = [line for line in lines if not line.startswith("try  ")]
    assert reason.startswith("no chat line for tiny-gpt-oss: ")
    assert "KeyError: '<|end|>'" in reason
    # a real GPT-OSS has harmony's tokens
    for model in ("tiny-chat", "openai/gpt-oss-20b"):
        urls = [line.split()[2] for line in serve.try_lines("h", 1, model)]
        assert [url.rsplit("/", 1)[1] for url in urls] == ["completions"] * 2


def test_tiny_gpt_oss_chat_fails_as_the_reason_says():
    """What NO_CHAT says, checked on vLLM itself: the parser vLLM gives a GPT-OSS model
    by default cannot be made with the tiny GPT-OSS's tokenizer (every chat request
    makes one)."""
    model = serve.ensure_tiny_model(Path(sys.executable), "tiny-gpt-oss")
    (arch,) = json.loads((model / "config.json").read_text())["architectures"]
    outputs = SimpleNamespace(reasoning_parser="")
    graphs = SimpleNamespace(cudagraph_capture_sizes=[1], max_cudagraph_capture_size=1)
    config = SimpleNamespace(
        structured_outputs_config=outputs, compilation_config=graphs
    )
    MODELS_CONFIG_MAP[arch].verify_and_update_config(config)
    assert outputs.reasoning_parser == "openai_gptoss"
    parser = ReasoningParserManager.get_reasoning_parser(outputs.reasoning_parser)
    with pytest.raises(KeyError, match=re.escape("'<|end|>'")):
        parser(AutoTokenizer.from_pretrained(model))


def _printed_requests(log_text: str) -> list[tuple[str, dict]]:
    """The (url, body) of each `curl` line `forkbuild serve` printed for the user."""
    requests = []
    for line in log_text.splitlines():
        if "serve: try  curl " in line:
            words = shlex.split(line.split("serve: try  ", 1)[1])
            requests.append((words[1], json.loads(words[words.index("-d") + 1])))
    return requests


def _check_greedy_answers(base: str) -> None:
    """Eight greedy tokens from each endpoint, text and chat message."""
    greedy = {"model": "tiny-chat", "max_tokens": 8, "temperature": 0}
    greedy["ignore_eos"] = True
    text = post(f"{base}/v1/completions", {**greedy, "prompt": "Hello, world!"})
    assert isinstance(text["choices"][0]["text"], str) and text["choices"][0]["text"]
    messages = [{"role": "user", "content": "Hello, world!"}]
    chat = post(f"{base}/v1/chat/completions", {**greedy, "messages": messages})
    message = chat["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"]
    for answer in (text, chat):  # system_fingerprint: the fork's vLLM
        assert answer["usage"]["completion_tokens"] == 8
        assert "+fork.1" in answer["system_fingerprint"]
    # the ChatML turn the template renders
    assert chat["usage"]["prompt_tokens"] > text["usage"]["prompt_tokens"]


def test_embedded_model_answers_a_completion_and_a_chat(tmp_path):
    # The GPU serve test's KV cache check, exercised here on CPU: the worker extension
    # passed through to vllm serve, and the dev-mode /collective_rpc that calls it.
    log_path = tmp_path / "serve.log"
    extension = ["--", "--worker-extension-cls", KV_CACHE_INSPECTION]
    with serving(extension, log_path, 300, stop_s=60, kill_s=30) as (port, _):
        base = f"http://127.0.0.1:{port}"
        # The two lines the user is told to try, sent as printed: both endpoints answer.
        printed = _printed_requests(log_path.read_text())
        urls = [f"{base}/v1/completions", f"{base}/v1/chat/completions"]
        assert [url for url, _ in printed] == urls
        for url, body in printed:
            answer = post(url, body)
            assert answer["model"] == "tiny-chat"
            assert 1 <= answer["usage"]["completion_tokens"] <= body["max_tokens"]
        _check_greedy_answers(base)
        # the demo's worker ran inside the engine core process (demo_engine_env)
        assert "(Worker pid=" not in log_path.read_text()
        # As the GPU serve test asks: one report per worker; the tiny chat model's two
        # groups (sliding, full) per layer, unpacked.
        (report,) = _kv_cache_reports(port)
        check_not_packed(report)
        assert len(report["layers"]) == 4, report["layers"]


def test_demo_engine_env_keeps_the_worker_in_the_engine_core(monkeypatch):
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    assert serve.demo_engine_env("tiny-chat") == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert serve.demo_engine_env(None) == {}  # a real model keeps vLLM's default
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    assert serve.demo_engine_env("tiny-chat") == {}  # the user's choice stands
