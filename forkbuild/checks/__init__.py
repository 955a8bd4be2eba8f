"""`make test` and what it proves on CPU: the run of every suite, the regression
proof (stock fails, the fork passes), patch status and the version matrix."""
