"""`vllm serve` through the fork. Without --model: the embedded tiny chat model (a
random-weight Gemma 2 made offline) whose sliding-window and full layers give GPT-OSS's
two KV cache groups, and whose ChatML template answers /v1/chat/completions (the tiny
GPT-OSS cannot: NO_CHAT). --preset offload-47054: vLLM issue #47054's cross-layer CPU KV
offloading on FlashAttention, with prefix caching and the hybrid KV cache manager."""

import argparse
import difflib
import json
import os
import re
import signal
import subprocess
from argparse import Namespace
from contextlib import suppress
from pathlib import Path

from forkbuild.core import log, preflight
from forkbuild.core.errors import ForkError
from forkbuild.core.pins import REPO_ROOT, Pins, build_dir

# Models `--model NAME` generates locally (no download), by their generator; the first
# is the default. tiny-gpt-oss is the #47054 model of the tests and GPU cases.
EMBEDDED = {
    "tiny-chat": "tests/v1/worker/tiny_chat_model.py",
    "tiny-gpt-oss": "tests/v1/worker/tiny_hybrid_model.py",
}
EMBEDDED_NAME = next(iter(EMBEDDED))
# Embedded models whose /v1/chat/completions fails, and why: `serve` prints this instead
# of the chat curl line (forkbuild/tests/test_serve.py checks the KeyError is real).
NO_CHAT = {
    "tiny-gpt-oss": (
        "vLLM gives every GPT-OSS model its GPT-OSS reasoning parser, which looks up "
        "harmony's token <|end|> in the model's tokenizer, and the tiny GPT-OSS's "
        "tokenizer (a small BPE trained locally) has none of harmony's chat tokens: "
        "/v1/chat/completions answers HTTP 500 (KeyError: '<|end|>'); /v1/completions "
        "works"
    ),
}
DEFAULT_CPU_BYTES = 8 * 2**30


def offload_47054_args(cpu_bytes: int) -> list[str]:
    """The #47054 configuration, as the report ran it (minus its model and TP size)."""
    extra = {"spec_name": "CPUOffloadingSpec", "enable_cross_layers_blocks": "True"}
    extra |= {"cpu_bytes_to_use": cpu_bytes, "eviction_policy": "lru"}
    kv_transfer = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
    kv_transfer["kv_connector_extra_config"] = extra
    return [
        *("--kv-transfer-config", json.dumps(kv_transfer), "--enable-prefix-caching"),
        *("--no-disable-hybrid-kv-cache-manager", "--attention-backend", "FLASH_ATTN"),
    ]


PRESETS = {"offload-47054": offload_47054_args}


def add_arguments(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument(
        "--model",
        help="model name or path, or an embedded model: "
        f"{', '.join(EMBEDDED)} (default: {EMBEDDED_NAME})",
    )
    preset = {"choices": sorted(PRESETS), "help": "a documented vLLM configuration"}
    cmd.add_argument("--preset", **preset)
    cmd.add_argument("--host", default="127.0.0.1")
    cmd.add_argument("--port", type=int, default=8000)
    cpu = "CPU memory for offloaded KV blocks, with --preset offload-47054"
    cmd.add_argument("--cpu-bytes", type=int, default=DEFAULT_CPU_BYTES, help=cpu)
    passed = "after --: passed to vllm serve unchanged"
    cmd.add_argument("vllm_args", nargs=argparse.REMAINDER, help=passed)


# A Hugging Face hub id: org/name (letters, digits, '-', '_', '.', not first).
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


def _hub_cache() -> Path:
    """Where huggingface_hub keeps downloaded models (its own defaults)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return Path(os.environ.get("HF_HOME") or cache / "huggingface") / "hub"


def check_model(model: str | None) -> None:
    """Refuse, before the install and hub lookups, a --model that is no embedded model,
    path, hub id org/name or cached bare name (more often a typo than hub's gpt2)."""
    try:
        exists = model is not None and Path(model).expanduser().exists()
    except (OSError, ValueError):  # a name too long for a path, a NUL byte
        exists = False
    if model is None or model in EMBEDDED or exists or HUB_ID.fullmatch(model):
        return
    bare = "/" not in model
    if bare and (_hub_cache() / f"models--{model}").is_dir():
        return
    close = difflib.get_close_matches(model.lower(), EMBEDDED, n=1)
    if bare or close:
        guess = f"; did you mean {close[0]}?" if close else ""
        raise ForkError(
            f"model {model!r} is neither an embedded model ({', '.join(EMBEDDED)}) nor "
            f"a local folder{guess}",
            "a hub model is named org/name (e.g. openai/gpt-oss-20b; gpt2 is "
            "openai-community/gpt2), a local folder by a path that exists",
        )
    raise ForkError(
        f"model {model!r} is not a local path that exists, nor a hub id org/name",
        "check the path, or name a hub model org/name (e.g. openai/gpt-oss-20b)",
    )


def start_tiny_model(python: Path, name: str = EMBEDDED_NAME) -> subprocess.Popen[str]:
    """Start generating model NAME (no-op when current) while the tree is installed."""
    out = build_dir() / "models" / name
    log.step(f"serve: preparing the embedded model {name} in {out}")
    out.parent.mkdir(parents=True, exist_ok=True)
    argv = [str(python), str(REPO_ROOT / EMBEDDED[name]), str(out)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    # Its output to a file, not a pipe nobody reads while the tree installs.
    with open(out.with_name(f"{name}.log"), "w") as report:
        into = {"stdout": report, "stderr": subprocess.STDOUT, "text": True}
        return subprocess.Popen(argv, env=env, **into)


def finish_tiny_model(generating: subprocess.Popen[str]) -> Path:
    out = Path(generating.args[-1])
    if generating.wait() != 0:
        report = out.with_name(f"{out.name}.log")
        lines = report.read_text().strip().splitlines()
        raise ForkError(
            f"could not generate the embedded model: {(lines or ['no output'])[-1]}",
            f"see {report}",
        )
    return out


def ensure_tiny_model(python: Path, name: str = EMBEDDED_NAME) -> Path:
    return finish_tiny_model(start_tiny_model(python, name))


def command(
    python: Path, model: str, args: Namespace, embedded: str | None, *, cpu=False
) -> list[str]:
    """The `vllm serve` command; EMBEDDED: the embedded model's name, when it is one."""
    cmd = [str(python.parent / "vllm"), "serve", model]
    cmd += ["--host", args.host, "--port", str(args.port)]
    if embedded:
        cmd += ["--served-model-name", embedded, "--max-model-len", "1024"]
        # A random-weight demo gains nothing from the CPU platform's Inductor compile,
        # which costs seconds of every start.
        cmd += ["--dtype", "bfloat16", *(["--enforce-eager"] if cpu else [])]
    if args.preset:
        cmd += PRESETS[args.preset](args.cpu_bytes)
    extra = args.vllm_args
    return cmd + list(extra[1:] if extra[:1] == ["--"] else extra)


def serve(pins: Pins, args: argparse.Namespace) -> None:
    # Everything that can be refused is refused before minutes of install and start-up.
    check_model(args.model)
    gpu = preflight.has_nvidia_gpu()
    if args.preset and not gpu:
        raise ForkError(
            f"--preset {args.preset} needs an NVIDIA GPU, and this machine has none "
            f"(vLLM {pins.upstream_version} offloads KV blocks to CPU only from "
            "CUDA-alike or XPU GPUs)",
            "run it on a GPU host, or serve without --preset",
        )
    if args.route == "cuda" and not gpu:
        no_gpu = "--route cuda needs an NVIDIA GPU, and this machine has none"
        raise ForkError(no_gpu, "use --route cpu")
    preflight.check_port_free(args.host, args.port)

    from forkbuild.setup import install

    route = install.pick_route(pins, args.route)
    embedded = args.model or EMBEDDED_NAME if args.model in (None, *EMBEDDED) else None
    generating = None
    if embedded:
        toolchain = install.ensure_toolchain(pins, route.name)
        generating = start_tiny_model(toolchain, embedded)
    try:
        python, _, route = install.install(pins, route.name)
    except BaseException:
        if generating:  # as Ctrl-C would: it removes its unfinished folder
            generating.send_signal(signal.SIGINT)
            with suppress(subprocess.TimeoutExpired):
                generating.wait(timeout=30)
            generating.kill()  # a no-op once it has exited
            generating.wait()
        raise
    model = str(finish_tiny_model(generating)) if generating else args.model
    model = os.path.expanduser(model)
    env = {**os.environ, **({"HF_HUB_OFFLINE": "1"} if embedded else {})}
    if route.target_device == "cpu":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB; vLLM's suits big hosts
        env.update(demo_engine_env(embedded))
    preflight.check_port_free(args.host, args.port)
    cmd = command(python, model, args, embedded, cpu=route.target_device == "cpu")
    log.step(f"serve: {' '.join(cmd)}")
    for line in try_lines(args.host, args.port, embedded or model):
        log.step(f"serve: {line}")
    os.execve(cmd[0], cmd, env)


def demo_engine_env(embedded: str | None) -> dict[str, str]:
    """The embedded model's CPU worker in the engine core: one vLLM import and OpenMP
    binding less at start-up. A real model, or the user's setting, keeps the default."""
    if not embedded or "VLLM_ENABLE_V1_MULTIPROCESSING" in os.environ:
        return {}
    return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def try_lines(host: str, port: int, model: str) -> list[str]:
    """The `try  curl ...` lines (the serve test sends them); NO_CHAT's reason."""
    base = f"curl http://{host}:{port}/v1"
    head = "-H 'Content-Type: application/json'"
    completion = {"model": model, "prompt": "Hello", "max_tokens": 8}
    chat = {"model": model, "messages": [{"role": "user", "content": "Hello"}]}
    chat["max_tokens"] = 8
    lines = [f"try  {base}/completions {head} -d '{json.dumps(completion)}'"]
    if model in NO_CHAT:
        return [*lines, f"no chat line for {model}: {NO_CHAT[model]}"]
    return [*lines, f"try  {base}/chat/completions {head} -d '{json.dumps(chat)}'"]
