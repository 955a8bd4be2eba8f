# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A pending offload of a block that NIXL loads into under MultiConnector
(vllm#46951).

The offloading connector defers a request's stores to the next engine step, so
a finished request's store may still read its blocks after they were freed.
Its scheduler fences that: a store whose source block is allocated again is
put in ``jobs_to_flush``, and the worker waits for it before the step's loads
start. With ``MultiConnector(NixlConnector, OffloadingConnector)`` a request
that NIXL loads asynchronously gets its blocks in a step where it is not in
``scheduled_new_reqs``; the only report of those blocks is
``update_state_after_alloc``. On vLLM 0.25.1 MultiConnector hands the
offloading connector empty blocks there and the offloading scheduler returns
before recording any block when it loads nothing itself, so the store is not
flushed: NIXL's transfer writes into blocks that the store is still reading,
and the offloaded copy of the finished request's prefix can hold the new
request's KV (a wrong cache hit later).

This drives vLLM's real scheduler (sync and async) with the real
``MultiConnector`` over the real ``NixlConnector`` scheduler side and the real
``OffloadingConnector``, whose worker side runs too: a request finishes with
its store still queued, its blocks are reused by a request that NIXL loads
asynchronously (``do_remote_prefill``), and the step that allocates them must
flush that store on the worker before the load starts; where the offloading
connector has the prefix too, it must not load it as well. Every case fails on
0.25.1 (the store is not flushed) and passes with patch 0009.

Replaced, as upstream's harness (``tests/v1/kv_connector/unit/``) does: the
offloading medium (``MockOffloadingSpec``: a scripted manager and a worker
whose transfers complete only when waited for), because the code under test
is the connector's scheduler, not a medium; NIXL's worker side, which needs
the nixl library and a remote engine (its scheduler side, which decides the
async load, imports and runs without nixl); and the harness's model, a
Hugging Face hub id, by a local config and tokenizer without weights (the
scheduler never loads a model), so that the test runs offline.
"""

import pytest

import tests.v1.kv_connector.unit.offloading_connector.utils as harness
from tests.v1.kv_connector.unit.utils import (
    EOS_TOKEN_ID,
    create_model_runner_output,
    create_request,
    create_scheduler,
    create_vllm_config,
)
from tests.v1.worker.offload_e2e_configs import offline_harness_model
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiConnector,
    MultiKVConnectorMetadata,
    MultiKVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.forward_context import ForwardContext
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

pytestmark = pytest.mark.cpu_test

BLOCK_SIZE = 4
# The null block and two blocks: the second request must reuse the first's.
NUM_GPU_BLOCKS = 3

NIXL = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
OFFLOADING = {
    "kv_connector": "OffloadingConnector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {
        "spec_name": "MockOffloadingSpec",
        "spec_module_path": harness.__name__,
    },
}


@pytest.fixture
def offline_model(tmp_path, monkeypatch) -> str:
    return offline_harness_model(harness, tmp_path / "model", monkeypatch)


class Engine:
    """The scheduler with MultiConnector and the offloading worker, stepped
    the way the engine core and the model runner's connector mixin step them."""

    def __init__(self, model: str, connectors: list[dict], async_scheduling: bool):
        # The harness's runner builds the real offloading worker (registered on
        # KV caches of NUM_GPU_BLOCKS) and the matching KV cache config.
        runner = harness.RequestRunner(
            block_size=BLOCK_SIZE,
            num_gpu_blocks=NUM_GPU_BLOCKS,
            async_scheduling=async_scheduling,
        )
        self.worker: OffloadingConnector = runner.worker_connector
        self.medium = runner.offloading_spec.handler

        vllm_config = create_vllm_config(
            model=model,
            hf_overrides={"max_position_embeddings": 10000},
            block_size=BLOCK_SIZE,
            kv_connector="MultiConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"connectors": connectors},
            # Not every sub-connector of every release supports HMA.
            disable_hybrid_kv_cache_manager=True,
        )
        vllm_config.scheduler_config.async_scheduling = async_scheduling
        self.scheduler = create_scheduler(
            vllm_config,
            num_blocks=NUM_GPU_BLOCKS,
            kv_cache_config=runner.scheduler.kv_cache_config,
        )
        multi = self.scheduler.connector
        assert isinstance(multi, MultiConnector)
        self.num_connectors = len(multi._connectors)
        self.offloading_idx = next(
            i
            for i, c in enumerate(multi._connectors)
            if isinstance(c, OffloadingConnector)
        )
        offloading = multi._connectors[self.offloading_idx].connector_scheduler
        assert offloading is not None
        self.offloading = offloading
        offloading.manager.prepare_store.side_effect = (
            lambda keys, req_context: harness.generate_store_output(keys)
        )
        self.async_scheduling = async_scheduling
        self._unprocessed: tuple[SchedulerOutput, ModelRunnerOutput] | None = None
        self._ctx = ForwardContext(
            no_compile_layers={}, attn_metadata={}, slot_mapping={}
        )
        self.store_blocks: dict[int, set[int]] = {}

    def step(self) -> tuple[SchedulerOutput, set[int]]:
        """One engine step; returns its output and the jobs the worker waited
        for before the step's loads."""
        output = self.scheduler.schedule()
        multi_meta = output.kv_connector_metadata
        assert isinstance(multi_meta, MultiKVConnectorMetadata)
        meta = multi_meta.metadata[self.offloading_idx]
        assert isinstance(meta, OffloadingConnectorMetadata)
        for job_id, job in meta.store_jobs.items():
            # 0.24 keeps a job's (src, dst) pair in transfer_spec.
            src = job.src_spec if hasattr(job, "src_spec") else job.transfer_spec[0]
            self.store_blocks[job_id] = {int(b) for b in src.block_ids}

        self.medium.flushed_jobs.clear()
        self.worker.handle_preemptions(meta)
        waited = set(self.medium.flushed_jobs)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(self._ctx)
        self.worker.wait_for_save()
        _, finished_recving = self.worker.get_finished(output.finished_req_ids)
        worker_meta = self.worker.build_connector_worker_meta()
        self.worker.clear_connector_metadata()

        # A MultiConnector's worker reports one metadata per sub-connector.
        model_output = create_model_runner_output(
            reqs=self.scheduler.running,
            finished_recving=finished_recving,
            token_id=EOS_TOKEN_ID,
            kv_connector_worker_meta=MultiKVConnectorWorkerMetadata(
                metadata=tuple(
                    worker_meta if i == self.offloading_idx else None
                    for i in range(self.num_connectors)
                )
            ),
        )
        if self.async_scheduling:
            if self._unprocessed is not None:
                self.scheduler.update_from_output(*self._unprocessed)
            self._unprocessed = (output, model_output)
        else:
            self.scheduler.update_from_output(output, model_output)
        return output, waited

    def blocks_of(self, request: Request) -> set[int]:
        (blocks,) = self.scheduler.kv_cache_manager.get_block_ids(request.request_id)
        return set(blocks)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(
    "connectors,offload_hit",
    [
        ([NIXL, OFFLOADING], False),
        ([OFFLOADING, NIXL], False),
        # The offloading connector has the prefix too, but NIXL comes first
        # and loads it: the offloading connector must not load as well.
        ([NIXL, OFFLOADING], True),
    ],
    ids=["nixl-then-offloading", "offloading-then-nixl", "both-hit-nixl-first"],
)
def test_reused_block_of_pending_store_is_flushed_before_nixl_load(
    offline_model: str,
    connectors: list[dict],
    offload_hit: bool,
    async_scheduling: bool,
):
    engine = Engine(offline_model, connectors, async_scheduling)

    # A local request fills both blocks, samples EOS and finishes; its store
    # of those blocks is queued and never completes on its own.
    local = create_request(
        request_id=1, num_tokens=2 * BLOCK_SIZE, max_tokens=1, block_size=BLOCK_SIZE
    )
    engine.scheduler.add_request(local)
    for _ in range(3):
        engine.step()
        if local.is_finished():
            break
    assert local.is_finished()
    pending = {
        job_id: blocks
        for job_id, blocks in engine.store_blocks.items()
        if job_id not in engine.medium.completed_jobs
    }
    assert pending, "expected the finished request's store to be still pending"

    if offload_hit:
        # 0.24's manager answers a lookup with a bool.
        lookup_result = getattr(harness, "LookupResult", None)
        engine.offloading.manager.lookup.return_value = (
            lookup_result.HIT if lookup_result else True
        )

    # A request that NIXL loads asynchronously from a remote prefill engine.
    remote = create_request(
        request_id=2,
        num_tokens=2 * BLOCK_SIZE,
        do_remote_prefill=True,
        num_remote_blocks=2,
        block_size=BLOCK_SIZE,
    )
    engine.scheduler.add_request(remote)
    output, waited = engine.step()
    assert remote.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    reused = engine.blocks_of(remote)
    stale = {job_id for job_id, blocks in pending.items() if blocks & reused}
    assert stale, f"expected blocks {reused} to reuse a pending store's blocks"

    # NIXL writes into `reused` from this step on: the stores that read them
    # must be flushed in this step, before the worker's loads start.
    multi_meta = output.kv_connector_metadata
    meta = multi_meta.metadata[engine.offloading_idx]
    assert stale <= (meta.jobs_to_flush or set()), (
        f"pending stores {stale} of reused blocks {reused} not flushed"
    )
    assert stale <= waited
    assert not meta.load_jobs, "the offloading connector loads what NIXL loads"
