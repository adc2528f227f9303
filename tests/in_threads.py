"""Run one call per key in threads of its own, as the processes of a store protocol would
(the row agreement, the commit vote): every call must meet the others in the store."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterable
from typing import TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


def in_threads(call: Callable[[K], V], keys: Iterable[K]) -> dict[K, V]:
    """``{key: call(key)}``, each call in its own thread, all started before any is joined."""
    results: dict[K, V] = {}

    def one(key: K) -> None:
        results[key] = call(key)

    threads = [threading.Thread(target=one, args=(key,)) for key in keys]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results
