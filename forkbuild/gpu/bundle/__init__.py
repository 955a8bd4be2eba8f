"""The GPU bundle: its build (build), its check on a simulated host (check), and
the GPU host's runner (runner, run.sh, standin, import_trace), which use the standard
library only.
"""
