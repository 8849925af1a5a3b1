"""GPU stages as SLURM jobs: the batch script, SLURM's own commands, and a Dagster Pipes client.

A step that runs on SLURM writes one batch script into a folder on the shared filesystem,
submits it with ``sbatch``, follows it with ``squeue``/``scontrol`` (logging pending reasons and
state changes), tails its output and the Pipes messages file from that folder while it runs,
cancels it with ``scancel`` when the Dagster run is terminated, and fails with the scheduler's
final state and the job's log tail when it ends in anything but ``COMPLETED``.
"""
