"""`graft bench cookbook --tenants 1,2`'s curve plumbing: the rows' arithmetic on made-up stats, and
the smallest real run (the tiny model on the session's vLLM server, 1 then 2 recipe processes of 2
steps) giving rows, the `--json` keys and the plot."""

import argparse
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console

from graft.bench.cookbook import measure_one
from graft.bench.cookbook_curve import arrival_stats, curve_row, curve_summary, plot_curve
from graft.models.cache import default_cache_dir
from graft.tenants.schedule import TrainerClock


def test_arrival_gaps_are_to_the_nearest_other_tenant_and_steps_per_tenant():
    arrivals = [(0.0, "a"), (1.0, "b"), (4.0, "a"), (4.5, "b"), (8.0, "a")]
    stats = arrival_stats(arrivals)
    assert stats["step_median_s"] == 4.0  # a: 4, 4; b: 3.5
    assert stats["gap_median_s"] == 1.0  # a: 1, 0.5, 3.5; b: 1, 0.5
    assert arrival_stats([(0.0, "a"), (3.0, "a")])["gap_median_s"] is None


def test_the_clock_counts_jobs_once_the_first_pass_began_by_their_functions_name():
    import functools

    clock = TrainerClock()

    def step(x):
        return x

    assert clock.timed(functools.partial(step, 1))() == 1 and clock.busy_s == 0.0  # before the first pass
    clock.start_s = 0.0
    clock.timed(functools.partial(step, 2))()
    clock.timed(lambda: step(3))()
    assert set(clock.busy_by_job_s) == {"step", "<lambda>"}
    assert sum(clock.busy_by_job_s.values()) == pytest.approx(clock.busy_s)


def test_a_row_and_the_summary_from_a_schedulers_stats(tmp_path):
    clock = TrainerClock(busy_s=8.0, start_s=100.0, end_s=110.0)
    scheduler = SimpleNamespace(clock=clock, pass_sizes={1: 1, 2: 3}, trained_tokens=500, arrivals=[])
    row = curve_row(2, scheduler, [tmp_path / "none"], seconds=20.0)
    assert row["trainer_busy_fraction"] == 0.8 and row["multi_tenant_pass_fraction"] == 0.75
    assert row["trained_tokens_per_s"] == 50.0 and row["passes"] == 4
    single = {**row, "tenants": 1, "trained_tokens_per_s": 20.0}
    summary = curve_summary([single, row])
    assert summary["aggregate_over_single"] == 2.5 and summary["trainer_busy_fraction"] == 0.8


@pytest.mark.vllm
def test_the_smallest_curve_runs_and_plots(base_dir, vllm_server, tmp_path):
    console = Console(stderr=True)
    from graft.bench.cookbook import cookbook_site

    site = cookbook_site(default_cache_dir(), console)
    args = argparse.Namespace(steps=2, groups=2, group_size=4, rank=8, learning_rate=1e-3, max_tokens=4,
                              loss_fn="importance_sampling", batch_window=None)
    rows = []
    for tenants in (1, 2):
        run = measure_one(vllm_server.url, base_dir, site, 4, argparse.Namespace(**vars(args), tenants=tenants),
                          tmp_path / f"n{tenants}", console)
        assert sorted(run.pop("rewards")) == [f"tenant{i + 1}" for i in range(tenants)]
        rows.append(run)
    for row in rows:  # one pass per tenant and step, some tokens trained and sampled in the span
        assert sum(int(size) * count for size, count in row["pass_sizes"].items()) == 2 * row["tenants"]
        assert row["trained_tokens_per_s"] > 0 and row["sampled_tokens"] > 0
        assert 0 < row["trainer_busy_fraction"] <= 1
        # the busy seconds by job: the shared passes, the optimizer steps and the reads publishing needs
        assert {"_shared_pass", "_optim_step", "_as_published"} <= set(row["trainer_busy_s_by_job"])
    summary = curve_summary(rows)
    assert summary["aggregate_over_single"] > 0 and summary["curve"] == rows
    png = plot_curve(rows, "test", tmp_path / "curve.png")
    assert Path(png).stat().st_size > 10_000
