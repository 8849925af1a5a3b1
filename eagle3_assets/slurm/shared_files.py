"""Reading files another host is writing, over the shared filesystem (NFS, Lustre, GPFS).

Each read reopens the file: on NFS an ``open`` revalidates the file's attributes (close-to-open
consistency), so appends made on a compute node show up here at the next poll, where an fd held
open could keep serving a cached size. Only whole lines are returned; a line still being written
waits for its newline.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import deque
from pathlib import Path

import dagster as dg


class FileTail:
    """New whole lines of a growing file since the last read; the last ``keep`` lines are remembered."""

    def __init__(self, path: Path, keep: int = 60):
        self.path = Path(path)
        self.offset = 0
        self.partial = b""
        self.last = deque(maxlen=keep)

    def read(self) -> list[str]:
        try:
            with self.path.open("rb") as fh:
                if os.fstat(fh.fileno()).st_size < self.offset:  # truncated (a requeued job starts its log anew)
                    self.offset, self.partial = 0, b""
                fh.seek(self.offset)
                chunk = fh.read()
        except FileNotFoundError:
            return []
        self.offset += len(chunk)
        *lines, self.partial = (self.partial + chunk).split(b"\n")
        text = [line.decode("utf-8", errors="replace").rstrip("\r") for line in lines]
        # tqdm redraws a line with carriage returns: keep the last state of it
        text = [t.rsplit("\r", 1)[-1] for t in text]
        self.last.extend(text)
        return text

    def tail(self, lines: int = 40) -> str:
        self.read()
        return "\n".join(list(self.last)[-lines:])


class SharedFileMessageReader(dg.PipesFileMessageReader):
    """Dagster's file message reader, reading by reopening the file each ``interval`` seconds and
    handing on only whole lines, so it works when the writer is a process on another host."""

    def __init__(self, path: str, interval: float = 0.5):
        super().__init__(path, cleanup_file=False)  # kept beside the job's log for a post-mortem
        self.interval = interval

    def _reader_thread(self, handler, is_resource_complete) -> None:
        tail = FileTail(Path(self._path), keep=1)
        try:
            while True:
                done = is_resource_complete.is_set()  # read once more after the session closes
                for line in tail.read():
                    if line.strip():
                        handler.handle_message(json.loads(line))
                if done:
                    return
                time.sleep(self.interval)
        except Exception:
            handler.report_pipes_framework_exception(f"{type(self).__name__} reader thread", sys.exc_info())
            raise

    def no_messages_debug_text(self) -> str:
        return f"Attempted to read messages from {self._path} on the shared filesystem."
