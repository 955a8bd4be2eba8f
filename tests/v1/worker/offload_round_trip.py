# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The vllm#47054 round trip through a real engine, shared by the CPU engine test
and the GPU end-to-end test: what passes on CPU is what runs on the GPU.

Two engines over the same model, one after the other:

- the #47054 engine (OffloadingConnector with cross-layer blocks): each prompt
  cold (its KV blocks are stored to the offload medium), the GPU prefix cache
  emptied, each prompt again (its blocks are loaded back);
- the baseline, the same engine without a KV connector: each prompt cold, then
  again, now from the GPU prefix cache.

The comparisons are deterministic by construction, not by luck:

- one request in flight whenever tokens are compared, so each forward pass runs
  the same batch on both engines (vLLM is not batch-invariant by default, and a
  random-weight model has near-tied logits);
- prompts long enough for whole offloaded blocks plus a tail of at most one GPU
  block, so the GPU prefix hit and the offload hit cover the same tokens
  (checked), and both engines compute the same suffix over the same K/V.

The connector's counters are read in a phase of their own: ``LLMEngine.step``
records scheduler stats (connector counters included) only on steps that
produced request outputs, and the step in which a load completes has none while
the reloading request is the only one. A filler request kept running while one
prompt reloads makes every step record.
"""

import gc
from collections.abc import Callable
from dataclasses import dataclass

STORE_BYTES = "vllm:kv_offload_store_bytes"
LOAD_BYTES = "vllm:kv_offload_load_bytes"


def prompt_token_ids(
    num_prompts: int,
    gpu_block_size: int,
    offloaded_block_size: int,
    full_blocks: int = 2,
) -> list[list[int]]:
    """Prompts of FULL_BLOCKS offloaded blocks plus a tail of 1..GPU-block tokens.

    The GPU prefix cache hits whole GPU blocks and the connector whole offloaded
    blocks, each leaving at least the last prompt token to compute; with such a
    tail both hit exactly ``full_blocks * offloaded_block_size`` tokens. Prompts
    differ from their first token on, so they share no cached block.
    """
    assert offloaded_block_size % gpu_block_size == 0
    length = full_blocks * offloaded_block_size + gpu_block_size // 3 + 1
    return [
        [(7 * i + 3 * j) % 300 + 10 for j in range(length)] for i in range(num_prompts)
    ]


@dataclass(frozen=True)
class Generation:
    token_ids: list[int]
    num_cached_tokens: int


def generate_alone(llm, prompt: list[int], max_tokens: int) -> Generation:
    """Greedy generation with no other request in flight."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    (output,) = llm.generate(
        [TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False
    )
    return Generation(list(output.outputs[0].token_ids), output.num_cached_tokens or 0)


def empty_gpu_prefix_cache(llm) -> None:
    """Drop every cached block from the GPU prefix cache (not the connector's).

    In vLLM 0.25.1 this succeeds at once when no request runs: the offloading
    scheduler's ``request_finished`` returns ``(False, None)``, so a finished
    request's blocks are freed although their stores may still be in flight.
    The connector fences those itself (a GPU block with a pending store is
    flushed before it is reused, and a lookup of a block still being stored
    waits), so there is nothing to wait for here. (Every request here ends by
    ``max_tokens``: one ending by EOS under async scheduling may free its blocks
    a step late.)
    """
    assert llm.reset_prefix_cache(), "the GPU prefix cache did not reset"


def counter(name: str) -> float:
    """A Prometheus counter of this process, summed over its labels."""
    import prometheus_client

    return sum(
        sample.value
        for metric in prometheus_client.REGISTRY.collect()
        if metric.name == name
        for sample in metric.samples
        if sample.name == name + "_total"
    )


def reload_beside_filler(
    llm, prompt: list[int], filler: list[int], filler_tokens: int
) -> Generation:
    """Reload PROMPT while a FILLER request decodes, so that the engine records
    the stats of every step, including the one in which the load completes. The
    filler is submitted first and must outlast the load: FILLER_TOKENS decode
    steps. Tokens of this phase are not compared (the batch differs)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    empty_gpu_prefix_cache(llm)
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=filler), TokensPrompt(prompt_token_ids=prompt)],
        [
            SamplingParams(temperature=0.0, max_tokens=filler_tokens, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
        ],
        use_tqdm=False,
    )
    reloaded = outputs[1]
    return Generation(
        list(reloaded.outputs[0].token_ids), reloaded.num_cached_tokens or 0
    )


@dataclass
class RoundTrip:
    """What both engines produced; ``check`` asserts what must hold."""

    prompts: list[list[int]]
    cold: list[Generation]  # baseline, first run of each prompt
    hit: list[Generation]  # baseline, the same prompt from the GPU prefix cache
    offload_cold: list[Generation]  # #47054 engine, first run (stores)
    reloaded: list[Generation]  # #47054 engine after emptying the GPU cache
    counted_reload: Generation  # the reload beside a filler request
    store_bytes: float
    load_bytes: float

    def check(self) -> None:
        for i, prompt in enumerate(self.prompts):
            hit = self.hit[i].num_cached_tokens
            assert 0 < hit < len(prompt), f"prompt {i}: baseline prefix hit {hit}"
            # Same hit length: both paths compute the same suffix over cached K/V.
            assert self.reloaded[i].num_cached_tokens == hit, (
                f"prompt {i}: {self.reloaded[i].num_cached_tokens} tokens loaded "
                f"from the offload medium, {hit} from the GPU prefix cache"
            )
            assert self.offload_cold[i].token_ids == self.cold[i].token_ids, (
                f"prompt {i}: cold run differs with the connector"
            )
            assert self.reloaded[i].token_ids == self.hit[i].token_ids, (
                f"prompt {i}: tokens after a reload differ from a prefix-cache hit"
            )
        assert self.counted_reload.num_cached_tokens == self.hit[0].num_cached_tokens
        assert self.store_bytes > 0, f"{STORE_BYTES} did not move"
        assert self.load_bytes > 0, f"{LOAD_BYTES} did not move"


def release_engine(llm) -> None:
    """Shut the engine down now, not when it is collected: the worker's shutdown
    also ends the process-global KV connector, which the next engine in the same
    process would otherwise find and use. Then free the distributed state and
    memory, as vLLM's own tests do between engines."""
    from vllm.distributed import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    gc.collect()
    cleanup_dist_env_and_memory()


def run_round_trip(
    make_llm: Callable[[bool], object],
    prompts: list[list[int]],
    max_tokens: int,
    *,
    filler_tokens: int,
) -> RoundTrip:
    """Run the #47054 engine (``make_llm(True)``) first, so that a broken tree
    fails before the baseline's minutes; then the baseline (``make_llm(False)``)."""
    llm = make_llm(True)
    try:
        # After the engine exists: its Prometheus logger replaces vLLM's collectors.
        store_before, load_before = counter(STORE_BYTES), counter(LOAD_BYTES)
        offload_cold = [generate_alone(llm, p, max_tokens) for p in prompts]
        empty_gpu_prefix_cache(llm)
        reloaded = [generate_alone(llm, p, max_tokens) for p in prompts]
        # Short enough to store nothing itself: less than one block.
        filler = [11] * 4
        counted = reload_beside_filler(llm, prompts[0], filler, filler_tokens)
        store_bytes = counter(STORE_BYTES) - store_before
        load_bytes = counter(LOAD_BYTES) - load_before
    finally:
        release_engine(llm)
        del llm

    baseline = make_llm(False)
    try:
        cold, hit = [], []
        for prompt in prompts:
            cold.append(generate_alone(baseline, prompt, max_tokens))
            hit.append(generate_alone(baseline, prompt, max_tokens))
    finally:
        release_engine(baseline)
        del baseline
    return RoundTrip(
        prompts, cold, hit, offload_cold, reloaded, counted, store_bytes, load_bytes
    )
