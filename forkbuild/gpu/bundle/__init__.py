"""The GPU bundle: build, check (on a simulated host), and the GPU host's runner
(runner, run.sh, standin, import_trace: the standard library only)."""
