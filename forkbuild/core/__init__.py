"""What every area imports: errors, log, hashing, the fork.toml reader, pre-flight
checks, the fix check, the pytest runner. Stdlib only: the GPU host's runner uses it."""
