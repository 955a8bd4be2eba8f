"""forkbuild: materialize, patch, install, serve and test the vLLM 0.25.1 fork. Its
areas, each importing only `core` and those below it (tests/test_code_shape.py): core <
setup < serve, gpu < checks < upstream, with cli.py on top."""
