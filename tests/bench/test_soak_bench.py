"""`graft bench soak`, short: adapter syncs under concurrent requests on a real vLLM server lose no
request, never hold more than max_loras adapters, and leave the server clean."""

import pytest

from graft.bench.soak import run_soak_bench
from graft.rollout.process_group import group_rss_bytes


def test_group_rss_counts_this_process_group():
    import os

    assert group_rss_bytes(os.getpgrp()) > 10 * 2**20  # at least this Python process with torch loaded


@pytest.mark.vllm
def test_a_short_soak_loses_no_request_and_keeps_the_window():
    result = run_soak_bench(cycles=30, keep=2, concurrency=4)
    assert result["requests_failed"] == 0, result["first_error"]
    assert result["requests_ok"] > 30 and result["max_adapters_loaded"] <= result["max_loras"] == 3
    assert result["unload_failures"] == 0 and result["left_loaded"] == []
    assert result["server_rss_mib"]["first"] > 100

