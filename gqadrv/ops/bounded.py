"""One bounded map for every process-wide cache of the op layer (routes, tensor maps, launch
plans, replays): insertion-ordered, evicting the oldest entries past ``maxsize``."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable

__all__ = ["BoundedMap"]


class BoundedMap:
    """A dict with a size bound. ``get`` is a plain dict lookup (the hot path); ``put`` evicts the
    oldest entry when full; ``get_or_create`` builds a missing value once under a lock."""

    __slots__ = ("_d", "maxsize", "_lock")

    def __init__(self, maxsize: int):
        self._d: OrderedDict = OrderedDict()
        self.maxsize = maxsize
        self._lock = threading.Lock()

    def get(self, key, default=None):
        return self._d.get(key, default)

    def put(self, key, value) -> Any:
        with self._lock:
            self._d[key] = value
            while len(self._d) > self.maxsize:
                self._d.popitem(last=False)
        return value

    def get_or_create(self, key, make: Callable[[], Any]) -> Any:
        hit = self._d.get(key)
        if hit is not None:
            return hit
        with self._lock:
            hit = self._d.get(key)
            if hit is None:
                hit = make()
                self._d[key] = hit
                while len(self._d) > self.maxsize:
                    self._d.popitem(last=False)
        return hit

    def clear(self) -> None:
        with self._lock:
            self._d.clear()

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, key) -> bool:
        return key in self._d

    def values(self):
        return list(self._d.values())
