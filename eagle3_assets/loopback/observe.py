"""What a loopback server saw, beyond counts: when each reply was delivered, and which groups of
requests (e.g. datasets) were in flight at the same time."""

from __future__ import annotations

import time
from collections import Counter


class Observer:
    """``group_of(body) -> str | None`` names a request's group (tests use the dataset a prompt came
    from); deliveries are (key, wall-clock seconds) once a reply's last byte was handed to the socket."""

    def __init__(self, group_of=None):
        self.group_of = group_of
        self.reset()

    def reset(self) -> None:
        self.first_request_at: float | None = None
        self.deliveries: list[tuple[str, float]] = []
        self.active: Counter = Counter()
        self.group_peaks: Counter = Counter()
        self.groups_at_once_peak = 0
        self.seen_groups: set = set()

    def enter(self, body) -> str | None:
        if self.first_request_at is None:
            self.first_request_at = time.time()
        if self.group_of is None:
            return None
        try:
            group = self.group_of(body)
        except Exception:  # noqa: BLE001 - an unrecognized body has no group
            return None
        if group is None:
            return None
        self.active[group] += 1
        self.seen_groups.add(group)
        self.group_peaks[group] = max(self.group_peaks[group], self.active[group])
        self.groups_at_once_peak = max(self.groups_at_once_peak, sum(1 for v in self.active.values() if v > 0))
        return group

    def leave(self, group: str | None) -> None:
        if group is not None:
            self.active[group] -= 1

    def delivered(self, key: str) -> None:
        self.deliveries.append((key, time.time()))

    def stats(self) -> dict:
        return {
            "first_request_at": self.first_request_at,
            "last_delivery_at": max((t for _, t in self.deliveries), default=None),
            "deliveries": [[k, t] for k, t in self.deliveries],
            "groups_seen": sorted(self.seen_groups),
            "groups_at_once_peak": self.groups_at_once_peak,
            "group_peaks": dict(self.group_peaks),
        }


def prefix_group(body) -> str | None:
    """The text before the first ':' of the first message (prompts written as '<dataset>: ...')."""
    content = body["messages"][0]["content"]
    return content.split(":", 1)[0] if isinstance(content, str) and ":" in content else None
