"""`make serve`: vllm serve through the fork, with the embedded tiny models."""
