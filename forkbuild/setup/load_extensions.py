"""`python -m forkbuild.setup.load_extensions WHEEL ROOT [PATH ...]`, run in the
environment to check (with the driver stub where there is none): loads every
`vllm/**.so` of WHEEL's RECORD this Python can (or only PATHs) from ROOT, held to
RECORD's sha256, against ROOT's torch. Prints one JSON line: what loaded, what failed
and why, those for other Pythons, whether torch sees a GPU, the kernel test's ops."""

import base64
import csv
import hashlib
import importlib.machinery
import importlib.util
import io
import json
import sys
import zipfile
from pathlib import Path

# The ops the GPU kernel test calls: the cache write, FlashAttention 2 and 3.
OPS = (
    "_C_cache_ops.reshape_and_cache_flash",
    "_vllm_fa2_C.varlen_fwd",
    "_vllm_fa3_C.fwd",
)


def wheel_record(wheel: Path) -> dict[str, str]:
    """Path -> RECORD's hash field (`sha256=<urlsafe base64>`) of each file of WHEEL."""
    with zipfile.ZipFile(wheel) as whl:
        name = next(n for n in whl.namelist() if n.endswith(".dist-info/RECORD"))
        rows = csv.reader(io.StringIO(whl.read(name).decode()))
        return {row[0]: row[1] for row in rows if row}


def record_digest(data: bytes) -> str:
    """DATA's sha256 as a wheel's RECORD writes it."""
    encoded = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return f"sha256={encoded.decode()}"


def probe(wheel: Path, root: Path, only: list[str]) -> dict:
    import torch

    record = wheel_record(wheel)
    compiled = sorted(p for p in record if p.startswith("vllm/") and p.endswith(".so"))
    wanted = [p for p in compiled if not only or p in only]
    result: dict = {"loaded": [], "other_pythons": [], "candidates": 0, "ops": {}}
    result["failed"] = {p: "not in the wheel's RECORD" for p in only if p not in record}
    here = (".abi3.so", importlib.machinery.EXTENSION_SUFFIXES[0])  # this Python loads
    for path in wanted:
        if not path.endswith(here):
            result["other_pythons"].append(path)
            continue
        result["candidates"] += 1
        target = root / path
        if not target.is_file():
            result["failed"][path] = f"missing from {root}"
            continue
        if record_digest(target.read_bytes()) != record[path]:
            result["failed"][path] = "differs from the wheel's RECORD"
            continue
        module = path[: -len(".so")].split(".")[0].replace("/", ".")
        try:
            spec = importlib.util.spec_from_file_location(module, target)
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
            result["loaded"].append(path)
        except Exception as exc:
            result["failed"][path] = f"{type(exc).__name__}: {exc}"
    result["cuda_available"] = torch.cuda.is_available()
    for op in OPS:
        namespace, name = op.split(".")
        try:
            schema = getattr(getattr(torch.ops, namespace), name).default._schema
            result["ops"][op] = str(schema)
        except (AttributeError, RuntimeError):
            result["ops"][op] = None
    return result


if __name__ == "__main__":
    print(json.dumps(probe(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:])))
