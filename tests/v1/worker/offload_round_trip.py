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

vLLM 0.25.1 logs nothing when it packs the KV cache, and a configuration that
stops packing would still pass the round trip (per-layer offloading works). So
each engine's workers report the KV cache they hold (``KVCacheInspection``, a
worker extension that ``collective_rpc`` calls by name; the serve test calls it
through the server's ``/collective_rpc``), and the #47054 engine's must be
packed block rows in HND order, the baseline's not packed.
"""

import gc
from collections.abc import Callable
from dataclasses import dataclass

STORE_BYTES = "vllm:kv_offload_store_bytes"
LOAD_BYTES = "vllm:kv_offload_load_bytes"

# ``worker_extension_cls`` for the engines (vllm/v1/worker/worker_base.py,
# WorkerWrapperBase.init_worker, adds it to the worker's bases) and the method
# name ``collective_rpc`` calls: a name, so that neither the engine core client
# nor the server's dev endpoint has to pickle a function.
KV_CACHE_INSPECTION = f"{__name__}.KVCacheInspection"
KV_CACHE_REPORT = "fork_kv_cache_report"


def kv_cache_report(worker) -> dict:
    """What WORKER's model runner holds as KV cache, as plain data (it crosses
    the engine core's msgpack and the server's JSON): the plan (the runner's
    ``kv_cache_config``), each attention layer's bound cache tensor (the one the
    forward pass reads: ``bind_kv_cache`` sets ``layer.kv_cache`` in the static
    forward context, on both the v1 and the v2 runner), and the layout."""
    from vllm.v1.attention.backends.utils import get_kv_cache_layout

    runner = worker.model_runner
    config = runner.kv_cache_config
    context = runner.compilation_config.static_forward_context
    layers = {}
    for group in config.kv_cache_groups:
        for name in group.layer_names:
            layer = context[name]
            kv_cache = layer.kv_cache
            storage = kv_cache.untyped_storage()
            layers[name] = {
                "backend": layer.attn_backend.get_name(),
                "shape": list(kv_cache.shape),
                "stride": list(kv_cache.stride()),
                "element_size": kv_cache.element_size(),
                "byte_offset": kv_cache.data_ptr() - storage.data_ptr(),
                "storage": storage.data_ptr(),
                "storage_bytes": storage.nbytes(),
            }
    return {
        "layout": get_kv_cache_layout(),
        "num_blocks": config.num_blocks,
        "groups": [
            {
                "spec": type(group.kv_cache_spec).__name__,
                "layer_names": list(group.layer_names),
                "page_size_bytes": group.kv_cache_spec.page_size_bytes,
            }
            for group in config.kv_cache_groups
        ],
        "tensors": [
            {
                "size": tensor.size,
                "shared_by": list(tensor.shared_by),
                "offset": tensor.offset,
                "block_stride": tensor.block_stride,
            }
            for tensor in config.kv_cache_tensors
        ],
        "layers": layers,
    }


class KVCacheInspection:
    """Worker extension: ``collective_rpc(KV_CACHE_REPORT)`` returns each
    worker's ``kv_cache_report``."""

    def fork_kv_cache_report(self) -> dict:
        return kv_cache_report(self)


def layer_index(layer_name: str) -> int:
    """4 for ``model.layers.4.self_attn.attn``."""
    parts = layer_name.split(".")
    return int(parts[parts.index("layers") + 1])


@dataclass(frozen=True)
class PackedKVCache:
    """The packed KV cache a GPT-OSS-like model (sliding-window and full
    attention layers) must get from vLLM 0.25.1's planner under
    ``enable_cross_layers_blocks`` (vllm/v1/core/kv_cache_utils.py,
    ``_get_kv_cache_config_packed``), seen by one worker: one group per
    attention type; block rows of one page per slot, slot i holding layer i of
    each group; every layer's view over one shared allocation, FlashAttention's
    and Triton's logical shape ``(blocks, 2, block, heads, dim)`` over pages in
    HND order ``(2, heads, block, dim)``."""

    backend: str  # FLASH_ATTN or TRITON_ATTN: that shape and HND order
    layer_types: tuple[str, ...]  # the model's, "sliding_attention"/"full_attention"
    num_kv_heads: int  # on this worker: the model's over the TP size
    head_size: int
    block_size: int
    dtype_bytes: int
    num_blocks: int | None = None  # where fixed (--num-gpu-blocks-override)

    @property
    def page_bytes(self) -> int:
        return (
            2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype_bytes
        )

    def layers_of(self, layer_type: str) -> set[int]:
        return {i for i, t in enumerate(self.layer_types) if t == layer_type}

    @property
    def slots(self) -> int:
        """Pages per block row: one per layer of a group (the groups are equal)."""
        return len(self.layers_of("full_attention"))


def check_packed(report: dict, expected: PackedKVCache) -> None:
    """REPORT (``kv_cache_report`` of one worker) is EXPECTED's packed cache."""
    page, slots = expected.page_bytes, expected.slots
    assert report["tensors"] and all(
        t["block_stride"] > 0 for t in report["tensors"]
    ), f"the KV cache was not packed: {report['tensors']}"
    assert report["layout"] == "HND", report["layout"]

    groups = {g["spec"]: g for g in report["groups"]}
    assert len(report["groups"]) == 2, f"not one group per attention type: {groups}"
    assert set(groups) == {"SlidingWindowSpec", "FullAttentionSpec"}, set(groups)
    for spec, layer_type in (
        ("SlidingWindowSpec", "sliding_attention"),
        ("FullAttentionSpec", "full_attention"),
    ):
        group = groups[spec]
        got = {layer_index(name) for name in group["layer_names"]}
        assert got == expected.layers_of(layer_type), (spec, got)
        assert group["page_size_bytes"] == page, (spec, group["page_size_bytes"])

    num_blocks = report["num_blocks"]
    if expected.num_blocks is not None:
        assert num_blocks == expected.num_blocks, num_blocks
    # One KVCacheTensor per slot, the row's pages side by side.
    tensors = report["tensors"]
    assert len(tensors) == slots, tensors
    assert [t["offset"] for t in tensors] == [i * page for i in range(slots)]
    for tensor in tensors:
        assert tensor["block_stride"] == slots * page, tensor
        assert tensor["size"] == num_blocks * slots * page, tensor
        # One layer of each group per slot.
        assert len(tensor["shared_by"]) == 2, tensor

    # The tensors the layers read: views into one allocation, each at its
    # slot's offset, block rows apart, heads outside tokens inside a page.
    offsets = {name: t["offset"] for t in tensors for name in t["shared_by"]}
    layers = report["layers"]
    assert set(layers) == set(offsets), (set(layers), set(offsets))
    assert len({layer["storage"] for layer in layers.values()}) == 1, (
        "the layers' KV caches are not views into one allocation"
    )
    e = expected.dtype_bytes
    b, h, d = expected.block_size, expected.num_kv_heads, expected.head_size
    for name, layer in layers.items():
        assert layer["backend"] == expected.backend, (name, layer["backend"])
        assert layer["element_size"] == e, (name, layer["element_size"])
        assert layer["storage_bytes"] == num_blocks * slots * page, (name, layer)
        assert layer["byte_offset"] == offsets[name], (name, layer["byte_offset"])
        assert layer["shape"] == [num_blocks, 2, b, h, d], (
            f"{name}: shape {layer['shape']}"
        )
        # Strides of (blocks, K/V, token, head, dim), in elements: HND pages.
        assert layer["stride"] == [slots * page // e, h * b * d, d, b * d, 1], (
            f"{name}: strides {layer['stride']}"
        )


def check_not_packed(report: dict) -> None:
    """REPORT (``kv_cache_report`` of one worker) holds per-layer KV caches."""
    tensors = report["tensors"]
    assert tensors and all(t["block_stride"] == 0 for t in tensors), (
        f"the KV cache is packed: {tensors}"
    )
    storages = {layer["storage"] for layer in report["layers"].values()}
    assert len(storages) == len(tensors), "layers of different tensors share memory"


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
    # kv_cache_report of each worker (checked by run_round_trip as each engine starts)
    offload_kv_caches: list[dict]
    baseline_kv_caches: list[dict]

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


def kv_cache_reports(llm) -> list[dict]:
    """kv_cache_report of each worker of LLM (made with
    ``worker_extension_cls=KV_CACHE_INSPECTION``)."""
    reports = llm.collective_rpc(KV_CACHE_REPORT)
    assert reports, "no worker reported its KV cache"
    return reports


def run_round_trip(
    make_llm: Callable[[bool], object],
    prompts: list[list[int]],
    max_tokens: int,
    *,
    filler_tokens: int,
    packed: PackedKVCache,
) -> RoundTrip:
    """Run the #47054 engine (``make_llm(True)``) first, so that a broken tree
    fails before the baseline's minutes; then the baseline (``make_llm(False)``).
    Both must be made with ``worker_extension_cls=KV_CACHE_INSPECTION``: as each
    starts, each of its workers must hold PACKED (the #47054 engine) or a KV cache
    not packed (the baseline); without packing the round trip would test
    per-layer offloading only."""
    llm = make_llm(True)
    try:
        offload_kv_caches = kv_cache_reports(llm)
        for report in offload_kv_caches:
            check_packed(report, packed)
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
        baseline_kv_caches = kv_cache_reports(baseline)
        for report in baseline_kv_caches:
            check_not_packed(report)
        cold, hit = [], []
        for prompt in prompts:
            cold.append(generate_alone(baseline, prompt, max_tokens))
            hit.append(generate_alone(baseline, prompt, max_tokens))
    finally:
        release_engine(baseline)
        del baseline
    return RoundTrip(
        prompts,
        cold,
        hit,
        offload_cold,
        reloaded,
        counted,
        store_bytes,
        load_bytes,
        offload_kv_caches,
        baseline_kv_caches,
    )
