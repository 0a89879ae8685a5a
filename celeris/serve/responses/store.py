"""The stored responses: a bounded in-memory map from response id to the response and its conversation, for
``GET /v1/responses/{id}`` and ``previous_response_id``.

It lives in the process that serves HTTP (one per app; with ``celeris serve --num-replicas`` that is the
ingress, in front of the engine replicas), holds at most ``max_entries`` responses (the least recently used
goes first) and forgets one ``ttl_s`` seconds after it was stored. Nothing is written to disk: a restart
forgets them all.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from celeris.serve.protocol import APIError
from celeris.serve.responses.convert import Item
from celeris.serve.responses.protocol import ResponseObject

MAX_ENTRIES = 1024
TTL_S = 3600.0


@dataclass(slots=True)
class StoredResponse:
    """One stored response and the conversation it ends (its input items, a previous response's included,
    then its output items as input items: what ``previous_response_id`` continues)."""

    response: ResponseObject
    conversation: list[Item]
    stored_at: float


class ResponseStore:
    """A bounded, expiring, thread-safe map of response id -> ``StoredResponse``.

    Args:
        max_entries: most responses kept (the least recently used is dropped first); >= 1.
        ttl_s: seconds a response is kept after it was stored; > 0.
        clock: monotonic seconds (tests pass a fake one).

    Raises:
        ValueError: ``max_entries`` < 1 or ``ttl_s`` <= 0.
    """

    def __init__(self, max_entries: int = MAX_ENTRIES, ttl_s: float = TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.max_entries, self.ttl_s, self.clock = max_entries, ttl_s, clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._entries)

    def put(self, response: ResponseObject, conversation: list[Item]) -> None:
        """Keep ``response`` (with the conversation it ends) under its id."""
        with self._lock:
            self._expire()
            self._entries[response.id] = StoredResponse(response, list(conversation), self.clock())
            self._entries.move_to_end(response.id)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        """The stored response ``response_id``.

        Raises:
            APIError: 404 ``response_not_found`` when it was never stored (``store: false``), was dropped, or
                expired; ``param`` names the request field that gave the id.
        """
        with self._lock:
            self._expire()
            entry = self._entries.get(response_id)
            if entry is not None:
                self._entries.move_to_end(response_id)
                return entry
        raise APIError(404, f"no stored response with id '{response_id}': it was never stored (store: false), or "
                            f"it expired (responses are kept {self.ttl_s:g} s, at most {self.max_entries} of them)",
                       param=param, code="response_not_found")

    def delete(self, response_id: str) -> None:
        """Forget ``response_id``.

        Raises:
            APIError: 404 as ``get``.
        """
        self.get(response_id)
        with self._lock:
            self._entries.pop(response_id, None)

    def _expire(self) -> None:
        cutoff = self.clock() - self.ttl_s  # reads reorder the entries (LRU), so look at each (at most max_entries)
        for rid in [rid for rid, e in self._entries.items() if e.stored_at <= cutoff]:
            del self._entries[rid]
