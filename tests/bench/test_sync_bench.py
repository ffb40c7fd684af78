import pytest

from graft.bench.sync import run_sync_bench


@pytest.mark.vllm
def test_sync_bench_measures_every_mode_against_a_real_server():
    result = run_sync_bench(("tiny",), repeats=1)
    rows = {row["mode"]: row for row in result["rows"]}
    assert set(rows) == {"adapter", "adapter-memory", "adapter-memory-shm", "adapter_publish", "merged", "full",
                         "raw_write"}
    assert all(row["model"] == "tiny" and row["seconds"] > 0 and row["bytes"] > 0 for row in rows.values())
    # An adapter is a small fraction of the model; merged and full publish the whole model.
    assert rows["adapter"]["bytes"] < rows["merged"]["bytes"] == rows["full"]["bytes"]
    assert rows["adapter_publish"]["seconds"] <= rows["adapter"]["seconds"]
    # The memory transports send the same tensors as one blob (the config in its header, not a file).
    for mode in ("adapter-memory", "adapter-memory-shm"):
        assert abs(rows[mode]["bytes"] - rows["adapter"]["bytes"]) < 0.05 * rows["adapter"]["bytes"]
