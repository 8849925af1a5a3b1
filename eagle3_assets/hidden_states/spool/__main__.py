"""``python -m eagle3_assets.hidden_states.spool --config producer.json``: one spool producer."""

from __future__ import annotations

import argparse
import signal
import sys

from eagle3_assets.hidden_states.spool.produce import ProducerJob, run_producer


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Capture hidden states into a training run's spool.")
    ap.add_argument("--config", required=True, help="a ProducerJob as JSON")
    ap.add_argument("--stop-when-idle", action="store_true", help="end once every planned position is consumed")
    args = ap.parse_args(argv)
    try:
        job = ProducerJob.from_json(args.config)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # SIGTERM (a stopped launch, scancel) unwinds like an error: the unit being captured goes back to the
    # pool at once, not after its lease is found dead
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    run_producer(job, stop_when_idle=args.stop_when_idle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
