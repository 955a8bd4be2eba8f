"""Empty modules in place of compiled vLLM extensions a GPU bundle's parts lack yet
(fork.toml [gpu_bundle] stand_in; why: docs/gpu-nightly.md). A pytest plugin (`-p`),
also loaded by the runner's vLLM probe before vLLM is; the modules: ENV's."""

import os
import sys
import types

ENV = "FORK_BUNDLE_STAND_INS"
MARK = "__fork_bundle_stand_in__"


def install(names: list[str]) -> list[str]:
    """Put an empty module under each of NAMES not imported yet; return NAMES."""
    for name in names:
        if name not in sys.modules:
            module = types.ModuleType(name, f"the GPU bundle's stand-in for {name}")
            setattr(module, MARK, True)
            sys.modules[name] = module
    return names


def from_env(variable: str = ENV) -> list[str]:
    """The names in VARIABLE, comma-separated."""
    return [name for name in os.environ.get(variable, "").split(",") if name]


install(from_env())
