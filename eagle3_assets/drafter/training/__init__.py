"""Drafter training: typed settings, streaming shard data, teacher, checkpoints, loop, entry point.

Run it with ``python -m eagle3_assets.drafter.training --config job.json`` (see ``__main__``).
"""
