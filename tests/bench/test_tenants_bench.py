"""`graft bench tenants` plumbing on a small base: both sides train, the isolation it reports is the
tenants' (exact here), and the memory it reports is the tenants' adapters and optimizer state."""

import argparse

import pytest

from graft.bench.tenants import run, run_tenants_bench


def test_the_bench_reports_throughput_isolation_and_the_state_tenants_add():
    result = run_tenants_bench(tenants=3, hidden=64, layers=1, datums=2, tokens=8, rounds=1)
    assert result["alone_tokens_per_s"] > 0 and result["together_tokens_per_s"] > 0
    assert result["aggregate_over_single"] == pytest.approx(result["together_tokens_per_s"] /
                                                            result["alone_tokens_per_s"])
    assert result["isolation_max_rel_diff"] <= 1e-6
    # 3 tenants x (rank 8 LoRA on 7 linear modules: A [8, in] + B [out, 8]) x (weights + 2 AdamW moments)
    assert result["tenant_state_bytes"] % (3 * 3 * 4) == 0 and 0 < result["tenant_state_bytes"] < result["base_bytes"]


def test_bad_sizes_are_refused_before_anything_starts():
    with pytest.raises(SystemExit, match="--tokens must be at least 2"):
        run(argparse.Namespace(tenants=2, hidden=64, layers=1, datums=1, tokens=1, rounds=1))
    with pytest.raises(SystemExit, match="--tenants must be at least 1"):
        run(argparse.Namespace(tenants=0, hidden=64, layers=1, datums=1, tokens=8, rounds=1))
