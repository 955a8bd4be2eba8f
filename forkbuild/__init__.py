"""forkbuild: materialize, patch, install, serve and test the vLLM 0.25.1 fork.

Its areas, each importing only `core` and the areas below it: core < setup < serve, gpu
< checks < upstream, with cli.py on top (forkbuild/tests/test_code_shape.py).
"""
