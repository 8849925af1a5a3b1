"""The spool: hidden states captured while a drafter trains, under a hard byte cap.

A directory under the data root that producers (the project's extraction backends, each its own
process) fill one *unit* at a time and the trainer empties, consume-once:

- ``plan.py``: the fixed order of samples (the offline sampler's own order), cut into units whose
  byte size is known before capture;
- ``store.py``: the directory itself: leases (O_EXCL files with pid, host and heartbeat), the
  cursor of what the trainer has consumed, the byte budget, atomic publish and deletion;
- ``produce.py``: the producer loop, ``python -m eagle3_assets.hidden_states.spool --config job.json``;
- ``preflight.py``: the disk the offline path would need against the cap, and a refusal of a cap
  below one optimizer step's worth of units.

The trainer's side is ``eagle3_assets/drafter/training/stream.py``; docs/streaming.md explains
the guarantees and the figures.
"""
