"""FlashInfer's JIT toolchain checked without compiling its kernels (a real module takes
minutes of nvcc): `python -m forkbuild.gpu.flashinfer_jit_probe WORK`, in the CUDA venv
with toolchain_env, prints probe()'s report as one JSON line."""

import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from forkbuild.gpu.driver_stub import needed_and_imported

# A runtime and a driver call (one the extensions import, so the stub defines it): gcc
# links --as-needed on Debian, so an unused -lcuda would leave no trace.
PROBE_CU = """#include <cuda_runtime.h>
extern "C" int cuCtxGetCurrent(void **context);
__global__ void k(float *x) { x[threadIdx.x] += 1; }
extern "C" int probe(float *x) { void *c; cuCtxGetCurrent(&c);
  k<<<1, 32>>>(x); return cudaGetLastError(); }
"""
LINKED = ("libcudart.so.13", "libcuda.so.1")


def compile_and_link(cuda_home: str, work: Path) -> tuple[bool, str, list[str]]:
    """(compiled, error, sonames of LINKED needed): nvcc compiles, c++ links."""
    source, obj, lib = work / "probe.cu", work / "probe.cuda.o", work / "probe.so"
    source.write_text(PROBE_CU)
    nvcc, cxx = os.path.join(cuda_home, "bin", "nvcc"), os.environ.get("CXX", "c++")
    steps = (
        [nvcc, "-c", "-Xcompiler", "-fPIC", "-arch=sm_80", str(source), "-o", str(obj)],
        [cxx, "-shared", str(obj), "-o", str(lib), "-lcudart", "-lcuda"],
    )
    for step in steps:
        try:
            built = subprocess.run(step, capture_output=True, text=True, check=False)
        except FileNotFoundError as exc:
            return False, f"{step[0]} not found: {exc}", []
        if built.returncode != 0:
            return False, (built.stderr or built.stdout)[-800:], []
    return True, "", sorted(n for n in needed_and_imported(lib)[0] if n in LINKED)


def probe(work: Path) -> dict:
    """Where FlashInfer finds CUDA, nvcc and ninja; "modules": the kernel test's paged
    prefill modules (FA2 and FA3, sliding and full) -> whether `ninja -n` resolves their
    build graph and it runs nvcc; whether a small CUDA file compiles and links as
    FlashInfer links, needing the runtime and the driver by soname."""
    import torch
    from flashinfer.jit import cpp_ext
    from flashinfer.prefill import gen_batch_prefill_module

    cuda_home = cpp_ext.get_cuda_path()
    compiled, error, links = compile_and_link(cuda_home, work)
    # q, kv and o bf16, int32 indices, head size 64 for q/k and v, no position encoding
    args = (torch.bfloat16,) * 3 + (torch.int32, 64, 64, 0)
    modules = {}
    for backend, sliding in itertools.product(("fa2", "fa3"), (False, True)):
        spec = gen_batch_prefill_module(backend, *args, sliding, False, False)
        spec.write_ninja()
        dry = ["ninja", "-n", "-C", str(spec.build_dir)]
        resolved = subprocess.run(dry, capture_output=True, check=False).returncode
        modules[spec.name] = resolved == 0 and "nvcc" in spec.ninja_path.read_text()
    return {
        "cuda_home": cuda_home,
        "ninja": shutil.which("ninja"),
        "nvcc": shutil.which("nvcc"),
        "cuda_version": str(cpp_ext.get_cuda_version()),
        "modules": modules,
        "compiled": compiled,
        "compile_error": error,
        "links": links,
    }


if __name__ == "__main__":
    print(json.dumps(probe(Path(sys.argv[1]))))
