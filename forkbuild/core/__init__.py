"""What every area imports. Stdlib only: the GPU host's runner uses it."""
