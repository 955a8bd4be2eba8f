"""The GPU cases the nightly job must run, per GPU kind and GPU count.

Counting failures is not enough: every GPU case skips itself when the hardware or a
kernel is missing (FA3 that does not import, one GPU for TP=2), so a broken install on
a Hopper runner would skip all FA3 and FLASH_ATTN cases and still leave the job green.
Here each kind lists what it must run; a skip or an absence of one of those fails the
job with pytest's reason. Standard library only: nightly.py runs on the system python3,
and `make test` checks on CPU that every node id listed here is collected.
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from forkbuild.errors import ForkError
from forkbuild.pytest_runner import Outcome

KERNELS = "tests/v1/worker/test_packed_kv_cache_gpu_kernels.py"
ENGINE = "tests/v1/worker/test_packed_kv_cache_offload_e2e.py"
SERVE = "forkbuild/tests/test_serve_gpu.py::test_offload_preset_serves_and_reloads"


def _fa(version: int) -> str:
    return f"{KERNELS}::test_flash_attention_over_packed_views[{version}]"


def _engine(case_id: str) -> str:
    """CASE_ID is `OffloadCase.id` of tests/v1/worker/offload_e2e_configs.py."""
    return f"{ENGINE}::test_offload_reload_matches_baseline[{case_id}]"


TRITON_KERNEL = f"{KERNELS}::test_triton_attention_over_packed_views"
# FlashInfer's paged prefill and decode, required from Ampere on.
# flashinfer-python 0.6.13 from the package index JIT-compiles these modules on first use
# (flashinfer-cubin holds other kernels): nvcc and ninja from the CUDA lock, a host
# compiler from the agent; nightly.py checks that toolchain before the tests start.
FLASHINFER_KERNELS = tuple(
    f"{KERNELS}::test_flashinfer_over_packed_views[{mode}]" for mode in ("prefill", "decode")
)

# One case's time limit, in seconds: at most a FlashInfer JIT build (a paged decode module
# for sm80 took 46 s with one job on 2 CPU cores) plus its kernels, or two tiny engines.
CASE_LIMIT_S = 600
# The per-case limit, by pytest-timeout, chosen for --forked (pytest-forked 1.7.5 runs
# each case's setup, call and teardown in a child; the parent waits in
# pytest_runtest_protocol). pytest-timeout's default timer (timeout_func_only=false)
# is set in the parent around that wait: its thread method os._exit()s the whole pytest
# (no JUnit XML at all), its signal method raises in the parent (an INTERNALERROR that
# ends the session and leaves the child running). With timeout_func_only=true the timer
# is set in pytest_runtest_call, i.e. in the child, around the test function: the
# thread method then dumps the stacks and os._exit()s the child alone, which the parent
# reports as that case's error ("running the test EXITED with status 1", after the dump),
# and the run goes on. Thread, not signal: a signal handler runs only when the
# main thread returns to the interpreter, and a hung CUDA call does not; the timer thread
# needs only the GIL, which torch releases while it waits on the GPU. A hang in a
# fixture's setup is not covered: the run's limit (RUN_LIMITS_S) is.
PER_CASE_TIMEOUT = [f"--timeout={CASE_LIMIT_S}", "--timeout-method=thread",
                    "-o", "timeout_func_only=true"]


Capability = tuple[int, int]  # CUDA compute capability (major, minor): 9.0 -> (9, 0)


@dataclass(frozen=True)
class Kind:
    """A GPU generation: from which compute capability, and what it must run."""

    name: str
    min_capability: Capability
    cases: tuple[str, ...]  # required with any number of GPUs
    multi_gpu_cases: tuple[str, ...] = ()  # required only with two GPUs or more

    def required(self, gpu_count: int) -> tuple[str, ...]:
        return self.cases + (self.multi_gpu_cases if gpu_count >= 2 else ())


AMPERE = Kind(
    "Ampere", (8, 0),
    (_fa(2), TRITON_KERNEL, *FLASHINFER_KERNELS, _engine("TRITON_ATTN-v1-tp1")),
)
# GPT-OSS's attention sinks need FA3, so every FLASH_ATTN engine case (TP=2 included)
# and the serve test (the preset uses FLASH_ATTN) are Hopper's.
HOPPER = Kind(
    "Hopper", (9, 0),
    AMPERE.cases + (
        _fa(3),
        _engine("FLASH_ATTN-v1-tp1"),
        _engine("FLASH_ATTN-v2-tp1"),
        _engine("FLASH_ATTN-v1-cpu64-tp1"),
        SERVE,
    ),
    (_engine("FLASH_ATTN-v1-tp2"),),
)
# Oldest first: a GPU is of the newest kind whose minimum it reaches (so 10.0 counts as
# Hopper and must run FA3 too; add a kind here when a newer one needs other cases).
KINDS: tuple[Kind, ...] = (AMPERE, HOPPER)


def all_required() -> set[str]:
    """Every node id that some GPU kind, with any GPU count, requires."""
    return {case for kind in KINDS for case in kind.required(gpu_count=2)}


def kind_of(capability: Capability) -> Kind | None:
    fitting = [kind for kind in KINDS if capability >= kind.min_capability]
    return fitting[-1] if fitting else None


# What the nightly asks nvidia-smi (with --format=csv): index and uuid to apply
# CUDA_VISIBLE_DEVICES, compute_cap to choose the kind; name and memory for the record.
NVIDIA_SMI_QUERY = "index,uuid,name,compute_cap,memory.total"


@dataclass(frozen=True)
class Gpu:
    index: int  # nvidia-smi's index (PCI bus order)
    uuid: str  # GPU-xxxxxxxx-...
    capability: Capability


def parse_gpus(csv_text: str) -> list[Gpu]:
    """Every GPU of `nvidia-smi --query-gpu=NVIDIA_SMI_QUERY --format=csv` (with its
    header line), whatever CUDA_VISIBLE_DEVICES says."""
    rows = list(csv.reader(io.StringIO(csv_text), skipinitialspace=True))
    header = [name.strip() for name in rows[0]] if rows else []
    if not {"index", "uuid", "compute_cap"} <= set(header):
        raise ForkError(
            f"nvidia-smi did not report the GPUs' index, uuid and compute capabilities: "
            f"{csv_text.strip()!r}",
            f"check the driver with `nvidia-smi --query-gpu={NVIDIA_SMI_QUERY} --format=csv`",
        )
    column = {name: header.index(name) for name in ("index", "uuid", "compute_cap")}
    gpus = []
    for row in rows[1:]:
        if not row:
            continue
        major, _, minor = row[column["compute_cap"]].strip().partition(".")
        gpus.append(Gpu(int(row[column["index"]]), row[column["uuid"]].strip(),
                        (int(major), int(minor or 0))))
    return gpus


def _by_uuid(entry: str, gpus: list[Gpu]) -> Gpu | None:
    """The one GPU whose UUID starts with ENTRY (CUDA takes unambiguous prefixes)."""
    matches = [gpu for gpu in gpus if gpu.uuid.startswith(entry)]
    return matches[0] if len(matches) == 1 else None


def _by_index(entry: str, gpus: list[Gpu]) -> Gpu | None:
    """The GPU of ENTRY's leading number (CUDA parses it like strtoul: `1gpu` is 1)."""
    number = re.match(r"\+?(\d+)", entry)
    if number is None:
        return None
    return next((gpu for gpu in gpus if gpu.index == int(number[1])), None)


def visible_gpus(gpus: list[Gpu], cuda_visible_devices: str | None) -> list[Gpu]:
    """The GPUs a CUDA process sees under CUDA_VISIBLE_DEVICES, as torch.cuda.device_count()
    (which the TP=2 case skips on) counts them: unset, all; a comma-separated list of
    indices, or of UUIDs or UUID prefixes when it starts with `GPU-`; the list ends at
    the first entry that names no GPU (so an empty value means none), and a GPU named
    twice leaves none. Indices are taken as nvidia-smi's, as torch does: CUDA numbers
    the fastest GPU first unless CUDA_DEVICE_ORDER=PCI_BUS_ID, which only differs on a
    host with GPUs of different kinds."""
    if cuda_visible_devices is None:
        return gpus
    if cuda_visible_devices.strip().startswith("MIG-"):
        raise ForkError(
            f"CUDA_VISIBLE_DEVICES={cuda_visible_devices!r} names MIG instances: the nightly "
            "GPU job needs whole GPUs (its kinds and TP=2 count GPUs)",
            "give the agent whole GPUs (indices or GPU- UUIDs), or unset CUDA_VISIBLE_DEVICES",
        )
    by_uuid = cuda_visible_devices.strip().startswith("GPU-")
    chosen: list[Gpu] = []
    for entry in (part.strip() for part in cuda_visible_devices.split(",")):
        if by_uuid:
            gpu = _by_uuid(entry, gpus) if entry.startswith("GPU-") else None
        else:
            gpu = _by_index(entry, gpus)
        if gpu is None:
            break
        if gpu in chosen:
            return []
        chosen.append(gpu)
    return chosen


def parse_nvidia_smi(csv_text: str, cuda_visible_devices: str | None = None) -> list[Capability]:
    """Compute capabilities, one per GPU that CUDA_VISIBLE_DEVICES (its value, None when
    unset) exposes, from `nvidia-smi --query-gpu=NVIDIA_SMI_QUERY --format=csv`. An agent
    pinned to one GPU of a larger host must not be asked for the TP=2 case."""
    gpus = parse_gpus(csv_text)
    visible = visible_gpus(gpus, cuda_visible_devices)
    if gpus and not visible:
        raise ForkError(
            f"CUDA_VISIBLE_DEVICES={cuda_visible_devices!r} leaves none of the {len(gpus)} "
            "GPU(s) nvidia-smi lists visible",
            "name the agent's GPUs by index or UUID as gpus.csv lists them, or unset it",
        )
    return [gpu.capability for gpu in visible]


def select(capabilities: list[Capability]) -> tuple[Kind, tuple[str, ...]]:
    """The kind of this machine and the cases it must run. With mixed GPUs the weakest
    decides: a case may land on any of them (TP=2 uses two)."""
    if not capabilities:
        raise ForkError("nvidia-smi listed no GPU", "check the driver with `nvidia-smi -L`")
    weakest = min(capabilities)
    kind = kind_of(weakest)
    if kind is None:
        oldest = KINDS[0]
        raise ForkError(
            f"compute capability {weakest[0]}.{weakest[1]} is older than {oldest.name} "
            f"({oldest.min_capability[0]}.{oldest.min_capability[1]}): the nightly GPU "
            "job has no cases that must run there",
            "run the job on the Ampere or Hopper queue (.buildkite/fork_nightly_gpu.yaml)",
        )
    return kind, kind.required(len(capabilities))


def not_run(required: Iterable[str], outcomes: Iterable[Outcome]) -> list[str]:
    """One line per required case that was skipped (with pytest's reason) or never
    reported. Failures and errors are not listed: the job counts those already."""
    cases: dict[str, str] = {}
    reasons: dict[str, str] = {}
    for outcome in outcomes:
        cases.update(outcome.cases)
        reasons.update(outcome.reasons)
    lines = []
    for node in required:
        status = cases.get(node)
        if status is None:
            lines.append(f"{node}: required but not run (not collected or not reported)")
        elif status in ("skipped", "xfailed"):
            lines.append(f"{node}: required but skipped: {reasons.get(node) or 'no reason given'}")
    return lines


def check_collected(collected: Collection[str], required: Collection[str] | None = None) -> None:
    """Fail unless every node id a GPU kind requires (or REQUIRED) is among COLLECTED (the
    GPU cases and forkbuild's tool tests as collected on CPU): a renamed test or parameter
    id must fail here, not as a 'required but not run' on the GPU runner at night."""
    missing = sorted(set(all_required() if required is None else required) - set(collected))
    if missing:
        raise ForkError(
            f"{len(missing)} node id(s) that the nightly GPU job requires are not collected: "
            + ", ".join(missing),
            "update the lists in forkbuild/gpu_required.py to the tests' current node ids "
            "(a renamed test or OffloadCase id), or restore the cases",
        )
