"""The shared core every area imports: errors, the progress log, hashing,
the one reader of fork.toml, the machine's pre-flight checks, the fix check and the
pytest runner.
Standard library only: the GPU host's runner imports it.
"""
