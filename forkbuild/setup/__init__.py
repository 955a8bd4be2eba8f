"""Set-up: pinned files fetched, the patched tree, locks, uv, venv, bytecode, wheel."""
