"""`graft bench tenants` plumbing on a small base: every side trains, tenants of other ranks and lengths
end bit-equal to themselves alone with `batch_invariant` (and within float rounding without), and the
memory it reports is the tenants' adapters and optimizer state."""

import pytest

from graft.bench.tenants import run_tenants_bench
from graft.cli import main


def test_the_bench_reports_throughput_isolation_and_the_state_tenants_add():
    result = run_tenants_bench(tenants=3, hidden=64, layers=1, datums=2, tokens=8, rounds=1)
    assert result["alone_tokens_per_s"] > 0 and result["together_tokens_per_s"] > 0
    assert result["aggregate_over_single"] == pytest.approx(result["together_tokens_per_s"] /
                                                            result["alone_tokens_per_s"])
    assert result["invariant_tokens_per_s"] > 0
    assert result["lengths"] == [8, 7, 6] and result["ranks"] == [8, 4, 16]
    assert result["isolation_max_rel_diff"] == 0.0 and result["isolation_default_max_rel_diff"] <= 1e-6
    # ranks 8 + 4 + 16, each a LoRA on 7 linear modules (A [r, in] + B [out, r]), x (weights + 2 AdamW moments)
    # x 4 bytes
    state = result["tenant_state_bytes"]
    assert state % (3 * 4 * (8 + 4 + 16)) == 0 and 0 < state < result["base_bytes"]


@pytest.mark.parametrize(("flags", "error"), [(["--tokens", "1"], "argument --tokens: must be at least 2 (got 1)"),
                                             (["--tenants", "0"], "argument --tenants: must be at least 1 (got 0)")])
def test_bad_sizes_are_refused_before_anything_starts(capsys, flags, error):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "tenants", *flags])
    assert exit_info.value.code == 2 and error in capsys.readouterr().err
