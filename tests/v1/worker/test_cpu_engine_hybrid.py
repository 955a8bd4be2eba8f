# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The engine end to end on a hybrid (sliding-window + full attention) model.

A tiny random-weight GPT-OSS, generated locally, through the real engine:
KV cache planning for two groups, allocation, reshape and generation. Greedy
output must be the requested length and identical across two runs, so a broken
install or KV cache initialisation shows here rather than on a GPU host.
"""

import importlib.util

import pytest

from tests.v1.worker.tiny_hybrid_model import make_tiny_gpt_oss
from vllm import LLM, SamplingParams
from vllm.platforms import current_platform

pytestmark = pytest.mark.cpu_test

PROMPTS = ["Hello, world!", "Key and value caches are offloaded"]


@pytest.mark.skipif(not current_platform.is_cpu(), reason="exercises the CPU engine")
@pytest.mark.skipif(
    importlib.util.find_spec("vllm._C") is None,
    reason="this vLLM build has no vllm._C: the CPU engine needs a CPU build's kernels",
)
def test_tiny_gpt_oss_generates_deterministically(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # A fixed, small KV cache: by default the CPU engine claims most of the host.
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    model = make_tiny_gpt_oss(tmp_path / "tiny-gpt-oss")
    llm = LLM(
        model=str(model),
        dtype="bfloat16",
        max_model_len=256,
        max_num_seqs=4,
        enforce_eager=True,
        seed=0,
    )
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    first = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, params)]
    second = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, params)]
    assert [len(ids) for ids in first] == [12, 12]
    assert first == second
