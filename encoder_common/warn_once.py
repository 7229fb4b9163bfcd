"""A warning logged once per cause: a condition that recurs on every call (a full volume, a refused
offer) shows up once at WARNING, then at DEBUG."""

from __future__ import annotations

import logging


class WarnOnce:
    def __init__(self, log: logging.Logger):
        self._log = log
        self._seen: set[str] = set()

    def __call__(self, key: str, message: str, *args) -> None:
        level = logging.DEBUG if key in self._seen else logging.WARNING
        self._seen.add(key)
        self._log.log(level, message, *args)
