"""One script per measurement; run each from the repository root as `python -m benchmarks.NAME --help`."""
