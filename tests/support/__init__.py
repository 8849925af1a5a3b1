"""What the tests (and some benchmarks, run from the checkout) use that users never run: private SLURM
clusters, a ``dagster dev`` starter, the small drafter, stand-ins for SGLang's modules and capture."""
