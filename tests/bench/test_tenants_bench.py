"""`graft bench tenants` plumbing on a small base: both sides train, the isolation it reports is the
tenants' (exact here), and the memory it reports is the tenants' adapters and optimizer state."""

import pytest

from graft.bench.tenants import run_tenants_bench
from graft.cli import main


def test_the_bench_reports_throughput_isolation_and_the_state_tenants_add():
    result = run_tenants_bench(tenants=3, hidden=64, layers=1, datums=2, tokens=8, rounds=1)
    assert result["alone_tokens_per_s"] > 0 and result["together_tokens_per_s"] > 0
    assert result["aggregate_over_single"] == pytest.approx(result["together_tokens_per_s"] /
                                                            result["alone_tokens_per_s"])
    assert result["isolation_max_rel_diff"] <= 1e-6
    # 3 tenants x (rank 8 LoRA on 7 linear modules: A [8, in] + B [out, 8]) x (weights + 2 AdamW moments)
    assert result["tenant_state_bytes"] % (3 * 3 * 4) == 0 and 0 < result["tenant_state_bytes"] < result["base_bytes"]


@pytest.mark.parametrize(("flags", "error"), [(["--tokens", "1"], "argument --tokens: must be at least 2 (got 1)"),
                                             (["--tenants", "0"], "argument --tenants: must be at least 1 (got 0)")])
def test_bad_sizes_are_refused_before_anything_starts(capsys, flags, error):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "tenants", *flags])
    assert exit_info.value.code == 2 and error in capsys.readouterr().err
