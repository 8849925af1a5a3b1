"""``python -m eagle3_assets.hidden_states.spool --config producer.json``: one spool producer."""

from __future__ import annotations

import signal
import sys

from eagle3_assets.files import DiskFull, InsufficientDiskSpace
from eagle3_assets.hidden_states.spool.produce import ProducerJob, run_producer
from eagle3_assets.job_file import run_job_main


def _run(job: ProducerJob, args, _pipes) -> int:
    # SIGTERM (a stopped launch, scancel) unwinds like an error: the unit being captured goes back to the
    # pool at once, not after its lease is found dead
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    run_producer(job, stop_when_idle=args.stop_when_idle)
    return 0


def main(argv: list[str] | None = None) -> int:
    # producers report through the spool's files and their own logs, never through Pipes; a full disk is
    # one line (recorded in the spool's failed.json for the trainer), not a traceback
    return run_job_main(ProducerJob, _run, argv, reports=lambda _job: False, refused=(DiskFull, InsufficientDiskSpace),
                        description="Capture hidden states into a training run's spool.",
                        options={"--stop-when-idle": {"action": "store_true",
                                                      "help": "end once every planned position is consumed"}})


if __name__ == "__main__":
    sys.exit(main())
