"""forkbuild: materialize, patch, install, serve and test the vLLM 0.25.1 fork.

The pipeline, one module a step: pins -> fetch -> tree -> install -> (wheel | serve |
regression).
"""
