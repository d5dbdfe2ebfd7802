"""The soak benchmark's bookkeeping (its full run is `pagedllm bench soak`, minutes long, reported in docs)."""

from __future__ import annotations

from pagedllm.bench.soak import error_code


def test_an_error_event_is_recorded_by_its_code():
    assert error_code(' {"error": {"message": "m", "type": "server_error", "code": "engine_restarting"}}') == \
        "engine_restarting"
    assert error_code('{"error": {"message": "m", "type": "invalid_request_error", "code": null}}') == \
        "invalid_request_error"
    assert error_code("{not json") == "unreadable"
    assert error_code("[1, 2]") == "unreadable"
