"""What `import vllm` gives in a venv, run in the tree (first on sys.path): one JSON
line (the package, its version, platform, fixed module), or with `origin` its path."""

import importlib.metadata
import json
import sys
from pathlib import Path

from forkbuild.core import fixcheck


def probe() -> dict:
    import vllm
    from vllm.platforms import current_platform

    cpu_kernels = None
    if current_platform.device_type == "cpu":  # the kernels this host's ISA loads
        import torch

        current_platform.import_kernels()
        cpu_kernels = hasattr(torch.ops._C, "init_cpu_memory_env")
    return {
        "vllm": vllm.__file__,
        "version": importlib.metadata.version("vllm"),
        "platform": type(current_platform).__name__,
        "device": current_platform.device_type,
        # Read, not imported: importing the module costs ~8 s.
        "source": (Path(vllm.__file__).parents[1] / fixcheck.MODULE_PATH).read_text(),
        "cpu_kernels": cpu_kernels,
    }


if __name__ == "__main__":
    if sys.argv[1:] == ["origin"]:
        import vllm

        print(vllm.__file__)
    else:
        print(json.dumps(probe()))
