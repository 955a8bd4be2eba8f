"""Set-up: the pinned upstream files fetched and verified, the patched tree, the
locks, uv, the venv's install, the bytecode cache and the patched wheel.
"""
