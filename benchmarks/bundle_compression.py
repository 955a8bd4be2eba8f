"""The GPU bundle's compression, each speed-up side by side with it off, in one run.

The components are the reference host's, made by forkbuild/gpu/bundle/build.py's own
functions from the CUDA route that `make test` builds (build/cuda-route; the import
trace of build/test-results/gpu-bundle-trace.json when there, else traced anew). Each
candidate compresses all of them into a scratch store of its own (the download cache
is not touched), timed by wall clock; the sizes are then packed into parts as
`make gpu-bundle` packs them. The baseline, "off", is main's: xz preset 6, one stream
per component, 2 processes.

Run from the repository root:  PYTHONPATH=. build/venv/bin/python \\
    benchmarks/bundle_compression.py [--candidates off,xz] [--base off] \\
    [--components vllm,packages]
Prints a table and writes one JSON object to stdout's last line.
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import shutil
import tempfile
import time
from pathlib import Path

from forkbuild.core import pins as fork_pins
from forkbuild.gpu import cuda_route
from forkbuild.gpu.bundle import build as gpu_bundle

L2, X86 = lzma.FILTER_LZMA2, lzma.FILTER_X86
CORES = os.cpu_count() or 1
CANDIDATES = {
    "off": gpu_bundle.Codec("xz", ({"id": L2, "preset": 6},), chunk=1 << 40, workers=2),
    "cores": gpu_bundle.Codec("xz", ({"id": L2, "preset": 6},)),  # 32 MiB streams
    "x86-3": gpu_bundle.Codec("xz", ({"id": X86}, {"id": L2, "preset": 3})),
    "xz": gpu_bundle.XZ,  # the x86 filter, preset 6, every core
    # XZ with fork.toml [gpu_bundle] xz_preset (parts 2-4 faster): make gpu-bundle's
    "presets": gpu_bundle.transfer_codec(fork_pins.load_gpu_bundle()),
    "plain": gpu_bundle.PLAIN,  # the simulated host's bundle: no transfer carries it
}


def source(pins: fork_pins.Pins) -> gpu_bundle.Source:
    home = cuda_route.home()
    route = (home / "venv/bin/python", home / f"vllm-{pins.upstream_version}")
    route += (home / "driver-stub",)
    traced = fork_pins.build_dir() / "test-results" / "gpu-bundle-trace.json"
    if not traced.is_file():
        return gpu_bundle.prepare(pins, traced.parent, route)
    found = json.loads(traced.read_text())
    trace = gpu_bundle.Trace(found["distributions"], tuple(found["tree_files"]))
    return gpu_bundle.Source(*route, trace, fork_pins.load_gpu_bundle())


def measure(made: gpu_bundle.Made, codec: gpu_bundle.Codec, settings) -> dict:
    with tempfile.TemporaryDirectory(dir=fork_pins.build_dir()) as store:
        start = time.monotonic()
        archives = gpu_bundle.compress(made.components, codec, Path(store))
        seconds = time.monotonic() - start
        sizes = {n: a.stat().st_size for n, a in archives.items()}
    order = [n for n in settings.order if n in sizes]
    extra = sum(p.stat().st_size for p in gpu_bundle.runner_files().values()) + 65536
    try:
        limit = int(settings.part_mib * 2**20)
        parts = {
            p.name: round(p.size / 2**20, 2)
            for p in gpu_bundle.pack(sizes, order, limit, extra)
        }
    except fork_pins.ForkError as exc:
        parts = {"do not fit": exc.cause}
    mib = {n: round(s / 2**20, 2) for n, s in sizes.items()}
    return {"seconds": round(seconds, 1), "mib": mib, "parts": parts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--candidates", default=",".join(CANDIDATES))
    parser.add_argument("--components", help="only these (default: all)")
    parser.add_argument("--base", default="off", help="the candidate ratios are to")
    args = parser.parse_args()
    pins = fork_pins.load()
    src = source(pins)
    work = Path(tempfile.mkdtemp(prefix=".bench-", dir=fork_pins.build_dir()))
    try:
        host = fork_pins.REPO_ROOT / src.settings.host
        made = gpu_bundle.components(pins, src, host, work)
        if args.components:
            wanted = args.components.split(",")
            made.components = [
                c for c in made.components if c.name.rsplit("/", 1)[-1] in wanted
            ]
        raw = {c.name: round(c.raw_size() / 2**20, 2) for c in made.components}
        found = {"cores": CORES, "raw_mib": raw, "candidates": {}}
        for name in args.candidates.split(","):
            found["candidates"][name] = measure(made, CANDIDATES[name], src.settings)
            print(name, json.dumps(found["candidates"][name]), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = found["candidates"].get(args.base)
    for name, got in found["candidates"].items():
        if base:
            got[f"time_vs_{args.base}"] = round(got["seconds"] / base["seconds"], 3)
            total = sum(got["mib"].values()) / sum(base["mib"].values())
            got[f"size_vs_{args.base}"] = round(total, 3)
        print(f"{name:6} {got['seconds']:8.1f} s  {sum(got['mib'].values()):8.1f} MiB")
    print(json.dumps(found))


if __name__ == "__main__":
    main()
