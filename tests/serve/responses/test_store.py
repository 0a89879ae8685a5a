"""ResponseStore: bounded (least recently used first out), expiring, 404 in the error shape."""

from __future__ import annotations

import pytest

from celeris.serve.protocol import APIError
from celeris.serve.responses.protocol import ResponseObject
from celeris.serve.responses.store import ResponseStore


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def response(rid: str) -> ResponseObject:
    return ResponseObject(id=rid, created_at=0, status="completed", model="m")


def test_get_returns_what_was_put_and_unknown_ids_are_404():
    store = ResponseStore()
    store.put(response("resp_a"), [])
    assert store.get("resp_a").response.id == "resp_a"
    with pytest.raises(APIError) as info:
        store.get("resp_b", "previous_response_id")
    assert info.value.status_code == 404 and info.value.code == "response_not_found"
    assert info.value.param == "previous_response_id" and "resp_b" in info.value.message


def test_the_least_recently_used_goes_first():
    store = ResponseStore(max_entries=2)
    store.put(response("resp_a"), [])
    store.put(response("resp_b"), [])
    store.get("resp_a")  # a is now the most recently used
    store.put(response("resp_c"), [])
    assert len(store) == 2
    store.get("resp_a"), store.get("resp_c")
    with pytest.raises(APIError):
        store.get("resp_b")


def test_entries_expire_ttl_seconds_after_they_were_stored_even_when_read():
    clock = Clock()
    store = ResponseStore(ttl_s=10, clock=clock)
    store.put(response("resp_a"), [])
    clock.t = 5
    store.put(response("resp_b"), [])
    store.get("resp_a")  # reading does not extend its life (and reorders the entries)
    clock.t = 10
    with pytest.raises(APIError):
        store.get("resp_a")
    assert store.get("resp_b").response.id == "resp_b"
    clock.t = 15
    assert len(store) == 0


def test_delete_forgets_and_bad_limits_are_refused():
    store = ResponseStore()
    store.put(response("resp_a"), [])
    store.delete("resp_a")
    with pytest.raises(APIError):
        store.delete("resp_a")
    with pytest.raises(ValueError, match="max_entries"):
        ResponseStore(max_entries=0)
    with pytest.raises(ValueError, match="ttl_s"):
        ResponseStore(ttl_s=0)
