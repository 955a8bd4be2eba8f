"""A pytest plugin (`-p forkbuild.gpu.bundle.import_trace`): the distributions and the
run folder's (the tree's) files a session imported, which a GPU host must have
(build.py), after importing last what the cases import only while they run.

  FORKBUILD_TRACE_OUT     the JSON file to write
  FORKBUILD_TRACE_BLOCK   top-level modules (comma-separated) the bundle leaves out,
                          made unimportable first
  FORKBUILD_TRACE_IMPORT  modules (comma-separated) to import at the session's end
"""

import importlib
import importlib.metadata
import json
import os
import sys
from pathlib import Path

from forkbuild.gpu.bundle.standin import from_env

for _blocked in from_env("FORKBUILD_TRACE_BLOCK"):
    # "Not installed" to find_spec, and so to vLLM's has_flashinfer()
    sys.modules[_blocked] = None  # type: ignore[assignment]


def distributions_of(files: set[Path]) -> dict[str, dict]:
    """Every installed distribution holding one of FILES (by its RECORD): name ->
    {"version", "requires" (markers evaluated, no extras)}. A distribution vendored
    inside another (its own metadata listed in that one's RECORD, as setuptools/
    _vendor's are) counts as that one."""
    from packaging.requirements import Requirement  # the venv's own

    owners: dict[Path, list[importlib.metadata.Distribution]] = {}
    for dist in importlib.metadata.distributions():
        for entry in dist.files or ():
            path = Path(str(dist.locate_file(entry))).resolve()
            owners.setdefault(path, []).append(dist)

    def vendored(dist: importlib.metadata.Distribution) -> bool:
        metadata = Path(str(dist._path)).resolve() / "METADATA"  # type: ignore[attr-defined]
        return any(other is not dist for other in owners.get(metadata, ()))

    found = {}
    for dist in {d for path in files for d in owners.get(path, ()) if not vendored(d)}:
        reqs = [Requirement(text) for text in dist.requires or ()]
        names = [
            r.name for r in reqs if not r.marker or r.marker.evaluate({"extra": ""})
        ]
        found[dist.metadata["Name"]] = {"version": dist.version, "requires": names}
    return found


def pytest_sessionfinish() -> None:
    failed = []
    for name in from_env("FORKBUILD_TRACE_IMPORT"):
        try:
            importlib.import_module(name)
        except Exception as exc:  # reported, not raised: the caller names them all
            failed.append(f"{name}: {type(exc).__name__}: {exc}")
    # Every module loaded now, sources and extensions (torch's _ops and _classes have a
    # relative __file__).
    found = [getattr(module, "__file__", None) for module in list(sys.modules.values())]
    files = {Path(f).resolve() for f in found if f and Path(f).is_absolute()}
    root = Path.cwd().resolve()
    report = {
        "distributions": distributions_of(files),
        "tree_files": sorted(
            str(f.relative_to(root)) for f in files if f.is_relative_to(root)
        ),
        "import_errors": failed,
    }
    out = Path(os.environ["FORKBUILD_TRACE_OUT"])
    out.write_text(json.dumps(report, indent=1) + "\n")
