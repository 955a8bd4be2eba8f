# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A connector cache reset while a request has a store in flight (vllm#48102).

``OffloadingConnectorScheduler.reset_cache()`` drops every transfer job and
ignores their late completions, so a request that survives the reset must
forget the job ids it still holds in ``transfer_jobs``. vLLM 0.25.1 kept them:
the request's next store looked a dropped id up in ``_jobs`` and
``Scheduler.schedule()`` raised ``KeyError``, which kills the engine core. Users
reach it through ``LLM.reset_prefix_cache(reset_connector=True)``,
``POST /reset_prefix_cache?reset_external=true`` and an RL framework's
``pause_generation(clear_cache=True)`` with requests kept across the pause.

This drives vLLM's real scheduler (sync and async) and the real
``OffloadingConnector`` on both sides through upstream's own harness
(``tests/v1/kv_connector/unit/offloading_connector/utils.py``): a running
request decodes with its stores in flight, the connector's cache is reset,
and the request keeps decoding to its end. It must re-store its blocks from
block 0, finish, and leave no job or request state behind. Every case fails on
0.25.1 (``KeyError`` in ``schedule()``) and passes with patch 0003.

Replaced, as upstream's harness does: the offloading medium
(``MockOffloadingSpec``: a scripted manager and a worker whose transfers
complete when the test says so), because the code under test is the
connector's scheduler, not a medium; and the harness's model, a Hugging Face
hub id, by a local config and tokenizer without weights (the scheduler never
loads a model), so that the test runs offline.
"""

import inspect

import pytest

import tests.v1.kv_connector.unit.offloading_connector.utils as harness
from tests.v1.kv_connector.unit.offloading_connector.utils import (
    generate_store_output,
    request_runner,  # noqa: F401  (fixture)
)
from tests.v1.kv_connector.unit.utils import EOS_TOKEN_ID
from tests.v1.worker.offload_e2e_configs import offline_harness_model

pytestmark = pytest.mark.cpu_test

BLOCK_SIZE = 4  # GPU block
FACTOR = 3  # GPU blocks per offloaded block
OFFLOADED = BLOCK_SIZE * FACTOR  # tokens per offloaded block


@pytest.fixture
def offline_model(tmp_path, monkeypatch):
    return offline_harness_model(harness, tmp_path / "model", monkeypatch)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_request_survives_reset_cache_with_store_in_flight(
    offline_model,
    request_runner,  # noqa: F811  (upstream's fixture, imported above)
    async_scheduling,
):
    # 0.26 renamed the harness's block_size_factor (offloaded blocks: chunks).
    factor_arg = (
        "blocks_per_chunk"
        if "blocks_per_chunk" in inspect.signature(harness.RequestRunner).parameters
        else "block_size_factor"
    )
    runner = request_runner(
        block_size=BLOCK_SIZE,
        num_gpu_blocks=100,
        async_scheduling=async_scheduling,
        **{factor_arg: FACTOR},
    )
    runner.manager.prepare_store.side_effect = lambda keys, req_context: (
        generate_store_output(keys)
    )
    connector = runner.connector_scheduler

    # A running request whose stores of two offloaded blocks stay in flight.
    runner.new_request(token_ids=[0] * OFFLOADED * 2)
    runner.run(decoded_tokens=[0], complete_transfers=False)
    status = connector._req_status[str(runner.req_id)]
    assert status.transfer_jobs, "expected a store in flight"

    # What reset_prefix_cache(reset_connector=True) and pause_generation(
    # clear_cache=True, mode="keep") reach while the request stays.
    connector.reset_cache()

    # The request keeps decoding to its end; its stores start again from
    # offloaded block 0, then cover the block its decoded tokens filled.
    runner._run([0] * OFFLOADED + [EOS_TOKEN_ID], complete_transfers=True)
    stored = {
        (block.group_idx, block.request_block_offset)
        for transfer in runner.completed_stores
        for block in transfer.gpu_blocks
    }
    assert stored == {(0, offset) for offset in range(3 * FACTOR)}
    assert not runner.scheduler.requests
    assert not connector._jobs, "jobs left behind"
    assert not connector._req_status, "request state left behind"
