import pytest

from graft.bench.sync import run_sync_bench


@pytest.mark.vllm
def test_sync_bench_measures_every_mode_against_a_real_server():
    result = run_sync_bench(("tiny",), repeats=1)
    rows = {row["mode"]: row for row in result["rows"]}
    assert set(rows) == {"adapter", "adapter_publish", "merged", "full", "raw_write"}
    assert all(row["model"] == "tiny" and row["seconds"] > 0 and row["bytes"] > 0 for row in rows.values())
    # An adapter is a small fraction of the model; merged and full publish the whole model.
    assert rows["adapter"]["bytes"] < rows["merged"]["bytes"] == rows["full"]["bytes"]
    assert rows["adapter_publish"]["seconds"] <= rows["adapter"]["seconds"]
