# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A CPU->GPU offloading load waits for the compute stream before it copies
(vllm#50696).

The CPU offloading worker (``vllm/v1/kv_offload/cpu/gpu_worker.py``) runs each
transfer on a stream of its own. In vLLM 0.25.1 only stores (GPU->CPU) make that
stream wait for the compute stream (``transfer_async``, :380-382); a load's copy
is ordered after nothing the model runner queued before it. The runner zeroes
freshly allocated blocks on the compute stream (models with Mamba layers, in
``_update_states`` before the connector starts its loads), and 0.25.1 zeroes a
load's destination blocks too; under async scheduling (0.25.1's default) or
with pipeline parallelism (the engine's batch queue) the compute stream may
still hold earlier steps' work. A copy that lands before that zeroing is
wiped, and one into a reused block that an earlier step still reads overwrites
KV in use: silent wrong output.

Each case submits transfers through the real ``CPUOffloadingWorker`` and
records the calls its handlers make on the stand-ins below. Every transfer,
load or store, must make its stream wait for the compute stream (the current
stream when it was submitted) before it issues its copy on that stream. Every
case fails on 0.25.1 (no load stream waits for the compute stream) and passes
with the fork's patch 0008, as on vLLM 0.28.0, the first release with the wait;
0.24, whose worker has another API, skips.

Stand-ins for CUDA, which this machine lacks (the worker, its handlers and
their ordering run unchanged): streams, events and the current-stream context
of a platform (``StandInCudaPlatform``, which forwards everything else to the
real platform), the copy op (it records its call), and CPU tensors that report
themselves as CUDA tensors, for the handler's device check.
"""

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from vllm import _custom_ops as ops
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.cpu import gpu_worker
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

pytestmark = pytest.mark.cpu_test

if not hasattr(gpu_worker, "CPUOffloadingWorker"):
    pytest.skip(
        "this vLLM has no CPUOffloadingWorker (0.25 introduced it; 0.24's "
        "CpuGpuOffloadingHandlers has another API)",
        allow_module_level=True,
    )

PAGE_SIZE = 4096
NUM_GPU_BLOCKS = 8
NUM_CPU_BLOCKS = 8


class DeviceMemory(torch.Tensor):
    """Stands in for a CUDA KV cache tensor: CPU memory that says it is CUDA's."""

    @property
    def is_cuda(self) -> bool:
        return True


class Timeline:
    """The calls made on the stand-ins, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []


class StandInStream:
    def __init__(self, timeline: Timeline, name: str) -> None:
        self.timeline = timeline
        self.name = name

    def wait_stream(self, other: "StandInStream") -> None:
        self.timeline.calls.append(("wait_stream", self, other))

    def wait_event(self, event: "StandInEvent") -> None:
        self.timeline.calls.append(("wait_event", self, event))

    def __repr__(self) -> str:
        return f"<stream {self.name}>"


class StandInEvent:
    """A CUDA event whose work is always done (nothing runs asynchronously)."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.stream: StandInStream | None = None

    def record(self, stream: StandInStream | None = None) -> None:
        self.stream = stream

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "StandInEvent") -> float:
        return 0.0


class StandInCudaPlatform:
    """The real platform, with CUDA's streams: the compute stream is current
    until a transfer enters its own stream's context."""

    def __init__(self, real: Any, timeline: Timeline) -> None:
        self._real = real
        self._timeline = timeline
        self.compute_stream = StandInStream(timeline, "compute")
        self._current = [self.compute_stream]
        self._num_streams = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def Stream(self) -> StandInStream:  # noqa: N802 (torch.cuda.Stream)
        self._num_streams += 1
        return StandInStream(self._timeline, f"transfer-{self._num_streams}")

    def current_stream(self) -> StandInStream:
        return self._current[-1]

    @contextlib.contextmanager
    def stream(self, stream: StandInStream) -> Iterator[None]:
        self._current.append(stream)
        try:
            yield
        finally:
            self._current.pop()


@pytest.fixture
def cuda_stand_ins(monkeypatch: pytest.MonkeyPatch) -> StandInCudaPlatform:
    """What stands in for CUDA in the worker's module, for one case."""
    timeline = Timeline()
    platform = StandInCudaPlatform(gpu_worker.current_platform, timeline)

    def copy(src, dst, sizes, *args, **kwargs) -> None:
        timeline.calls.append(("copy", platform.current_stream(), len(src)))

    monkeypatch.setattr(gpu_worker, "current_platform", platform)
    monkeypatch.setattr(gpu_worker.torch, "Event", StandInEvent)
    # Whichever copy the handler selects (the driver's or Triton's) records.
    monkeypatch.setattr(ops, "swap_blocks_batch", copy)
    monkeypatch.setattr(gpu_worker, "swap_blocks_batch", copy)
    # Pinned descriptor buffers need a CUDA driver; pinning does not order.
    monkeypatch.setattr(gpu_worker, "PIN_MEMORY", False)
    return platform


def _worker() -> Any:
    tensor = torch.zeros(NUM_GPU_BLOCKS, PAGE_SIZE, dtype=torch.int8)
    kv_caches = CanonicalKVCaches(
        tensors=[
            CanonicalKVCacheTensor(
                tensor=tensor.as_subclass(DeviceMemory), page_size_bytes=PAGE_SIZE
            )
        ],
        group_data_refs=[
            [CanonicalKVCacheRef(tensor_idx=0, page_size_bytes=PAGE_SIZE)]
        ],
    )
    return gpu_worker.CPUOffloadingWorker(kv_caches, 1, NUM_CPU_BLOCKS)


def _gpu_spec(blocks: list[int]) -> GPULoadStoreSpec:
    return GPULoadStoreSpec(blocks, group_sizes=(len(blocks),), block_indices=(0,))


def _load(
    worker: Any, timeline: Timeline, job_id: int, cpu: list[int], gpu: list[int]
) -> None:
    timeline.calls.append(("submit_load", job_id))
    assert worker.submit_load(job_id, CPULoadStoreSpec(cpu), _gpu_spec(gpu))


def _store(
    worker: Any, timeline: Timeline, job_id: int, gpu: list[int], cpu: list[int]
) -> None:
    timeline.calls.append(("submit_store", job_id))
    assert worker.submit_store(job_id, _gpu_spec(gpu), CPULoadStoreSpec(cpu))


def _first_load(worker: Any, timeline: Timeline) -> None:
    _load(worker, timeline, 1, [0, 1], [2, 3])


def _load_after_a_store(worker: Any, timeline: Timeline) -> None:
    # The store waits for compute on its own stream, which orders no load.
    _store(worker, timeline, 1, [0, 1], [4, 5])
    _load(worker, timeline, 2, [4, 5], [6, 7])


def _load_behind_a_load(worker: Any, timeline: Timeline) -> None:
    # Waiting for the load ahead of it does not order the second load after
    # compute work queued between the two.
    _load(worker, timeline, 1, [0, 1], [2, 3])
    _load(worker, timeline, 2, [2, 3], [4, 5])


def _load_on_a_reused_stream(worker: Any, timeline: Timeline) -> None:
    # A finished transfer's stream goes back to the pool; the next load reuses it.
    _load(worker, timeline, 1, [0, 1], [2, 3])
    assert [result.job_id for result in worker.get_finished()] == [1]
    _load(worker, timeline, 2, [2, 3], [4, 5])


SCENARIOS = {
    "first-load": _first_load,
    "load-after-a-store": _load_after_a_store,
    "load-behind-a-load": _load_behind_a_load,
    "load-on-a-reused-stream": _load_on_a_reused_stream,
}


def _submissions(calls: list[tuple[Any, ...]]) -> list[list[tuple[Any, ...]]]:
    """The calls split at each submission, the submission first."""
    parts: list[list[tuple[Any, ...]]] = []
    for call in calls:
        if call[0].startswith("submit_"):
            parts.append([])
        if parts:
            parts[-1].append(call)
    return parts


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_load_waits_for_compute_before_its_copy(
    scenario: str, cuda_stand_ins: StandInCudaPlatform
) -> None:
    platform = cuda_stand_ins
    timeline = platform._timeline
    worker = _worker()
    try:
        SCENARIOS[scenario](worker, timeline)
    finally:
        worker.shutdown()

    compute = platform.compute_stream
    transfers = _submissions(timeline.calls)
    num_loads = sum(part[0][0] == "submit_load" for part in transfers)
    assert num_loads == (1 if scenario in ("first-load", "load-after-a-store") else 2)
    # Stores keep their wait too: every transfer, load or store, is checked.
    for transfer in transfers:
        kind, job_id = transfer[0]
        copies = [i for i, call in enumerate(transfer) if call[0] == "copy"]
        assert len(copies) == 1, transfer
        copy_at = copies[0]
        stream = transfer[copy_at][1]
        assert stream is not compute, f"{kind} {job_id} copies on the compute stream"
        waited = ("wait_stream", stream, compute) in transfer[:copy_at]
        assert waited, (
            f"{kind} {job_id} issued its copy on {stream!r} without that stream "
            f"waiting for the compute stream first: {transfer}"
        )
