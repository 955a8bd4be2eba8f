"""The GPU cases the nightly job must run, per GPU kind and count (fork.toml [gpu]). A
GPU case skips itself when a kernel is missing, so a broken FA3 install would leave the
job green: a required case's skip or absence fails it with pytest's reason. Standard
library only: the GPU bundle's runner imports it."""

import csv
import io
import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from forkbuild.core.errors import ForkError
from forkbuild.core.pins import Capability, GpuKind, GpuTable, capability
from forkbuild.core.pytest_runner import Outcome

CASE_LIMIT_S = 600  # seconds: a FlashInfer JIT build and its kernels, or two engines
# pytest-timeout in the forked child, thread method: the hung case alone fails and the
# run goes on (docs/gpu-nightly.md, "Why the per-case limit is set so").
PER_CASE_TIMEOUT = [f"--timeout={CASE_LIMIT_S}", "--timeout-method=thread"]
PER_CASE_TIMEOUT += ["-o", "timeout_func_only=true"]

# What the nightly asks nvidia-smi (with --format=csv): index and uuid to apply
# CUDA_VISIBLE_DEVICES, compute_cap to choose the kind; name and memory for the record.
NVIDIA_SMI_QUERY = "index,uuid,name,compute_cap,memory.total"


@dataclass(frozen=True)
class Gpu:
    index: int  # nvidia-smi's index (PCI bus order)
    uuid: str  # GPU-xxxxxxxx-...
    capability: Capability


def visible_gpus(gpus: list[Gpu], cuda_visible_devices: str | None) -> list[Gpu]:
    """The GPUs a CUDA process sees, as torch.cuda.device_count() (which the TP=2 case
    skips on) counts them: unset, all; else indices, or UUIDs (prefixes) when it starts
    with `GPU-`, up to the first entry that names no GPU (empty: none); a GPU named
    twice leaves none. Indices are nvidia-smi's, as torch takes them (CUDA's fastest
    first differs only on a host with GPUs of different kinds)."""
    if cuda_visible_devices is None:
        return gpus
    if cuda_visible_devices.strip().startswith("MIG-"):
        raise ForkError(
            f"CUDA_VISIBLE_DEVICES={cuda_visible_devices!r} names MIG instances: the "
            "nightly GPU job needs whole GPUs (its kinds and TP=2 count GPUs)",
            "give the agent whole GPUs (indices or GPU- UUIDs), or unset "
            "CUDA_VISIBLE_DEVICES",
        )
    by_uuid = cuda_visible_devices.strip().startswith("GPU-")
    chosen: list[Gpu] = []
    for entry in (part.strip() for part in cuda_visible_devices.split(",")):
        if by_uuid:  # CUDA takes unambiguous UUID prefixes
            found = [g for g in gpus if g.uuid.startswith(entry)]
            gpu = found[0] if entry.startswith("GPU-") and len(found) == 1 else None
        else:  # the leading number, parsed as strtoul does (`1gpu` is 1)
            number = re.match(r"\+?(\d+)", entry)
            gpu = next((g for g in gpus if number and g.index == int(number[1])), None)
        if gpu is None:
            break
        if gpu in chosen:
            return []
        chosen.append(gpu)
    return chosen


def parse_nvidia_smi(csv_text: str, visible: str | None = None) -> list[Capability]:
    """Compute capabilities of the GPUs VISIBLE (CUDA_VISIBLE_DEVICES) shows, from
    `nvidia-smi --query-gpu=NVIDIA_SMI_QUERY --format=csv`: one of two gets no TP=2."""
    reader = csv.DictReader(io.StringIO(csv_text), skipinitialspace=True)
    if not {"index", "uuid", "compute_cap"} <= set(reader.fieldnames or ()):
        raise ForkError(
            "nvidia-smi did not report the GPUs' index, uuid and compute capabilities: "
            f"{csv_text.strip()!r}",
            f"check the driver with `nvidia-smi --query-gpu={NVIDIA_SMI_QUERY} "
            "--format=csv`",
        )
    gpus = [
        Gpu(int(g["index"]), g["uuid"].strip(), capability(g["compute_cap"].strip()))
        for g in reader
    ]
    shown = visible_gpus(gpus, visible)
    if gpus and not shown:
        raise ForkError(
            f"CUDA_VISIBLE_DEVICES={visible!r} leaves none of the "
            f"{len(gpus)} GPU(s) nvidia-smi lists visible",
            "name the agent's GPUs by index or UUID as gpus.csv lists them, "
            "or unset it",
        )
    return [gpu.capability for gpu in shown]


def select(
    capabilities: list[Capability], table: GpuTable
) -> tuple[GpuKind, tuple[str, ...]]:
    """The kind of this machine and the cases it must run. With mixed GPUs the weakest
    decides: a case may land on any of them (TP=2 uses two)."""
    if not capabilities:
        raise ForkError(
            "nvidia-smi listed no GPU", "check the driver with `nvidia-smi -L`"
        )
    weakest = min(capabilities)
    kind = table.kind_of(weakest)
    if kind is None:
        oldest = table.kinds[0]
        raise ForkError(
            f"compute capability {weakest[0]}.{weakest[1]} is older than {oldest.name} "
            f"({oldest.min_capability[0]}.{oldest.min_capability[1]}): the nightly GPU "
            "job has no cases that must run there",
            "run the job on one of the queues of fork.toml [gpu] kinds: "
            + ", ".join(q for kind in table.kinds for q, _ in kind.queues),
        )
    return kind, kind.required(len(capabilities))


def not_run(required: Iterable[str], outcomes: Collection[Outcome]) -> list[str]:
    """One line per required case skipped (with pytest's reason) or never reported;
    not failures and errors, which the job counts already."""
    cases = {node: status for o in outcomes for node, status in o.cases.items()}
    reasons = {node: why for o in outcomes for node, why in o.reasons.items()}
    lines, absent = [], "required but not run (not collected or not reported)"
    for node in required:
        if (status := cases.get(node)) is None:
            lines.append(f"{node}: {absent}")
        elif status in ("skipped", "xfailed"):
            why = reasons.get(node) or "no reason given"
            lines.append(f"{node}: required but skipped: {why}")
    return lines


def check_collected(collected: Collection[str], required: Collection[str]) -> None:
    """Every required node id among COLLECTED on CPU: a rename fails here, not later."""
    if missing := sorted(set(required) - set(collected)):
        raise ForkError(
            f"{len(missing)} node id(s) that the nightly GPU job requires are not "
            "collected: " + ", ".join(missing),
            "update fork.toml [gpu] cases to the tests' current node ids "
            "(a renamed test or OffloadCase id), or restore the cases",
        )
