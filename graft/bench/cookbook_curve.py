"""`graft bench cookbook --tenants 1,2,4,8`: the scaling curve, one row per number of tenants.

Each N is its own Tinker service (on one vLLM server started once for the largest N) and its own N
recipe processes. A row says what the service saw, from its scheduler's stats (graft.tenants.schedule:
`pass_sizes`, `trained_tokens`, `arrivals`, `clock`), read in this process (the service runs in a
thread here, `graft.tenants.background`), and from the recipes' metrics.jsonl:

- trained tokens/s: the tokens of the datums of the passes with a backward, over the training span
  (the first pass's start to the trainer's last job's end);
- sampled tokens/s: the recipes' `env/all/total_ac_tokens` of steps 2 on (step 1 samples before the
  span begins), over the same span;
- trainer busy fraction: the model thread's time in jobs over that span;
- the fraction of passes holding two tenants or more;
- step seconds: the median interval between a tenant's consecutive forward_backward arrivals;
- arrival gap: for each forward_backward arrival, the time to the nearest other tenant's arrival.

What bounds the curve on a 2-core machine: the vLLM server's engine runs on one core (vLLM-CPU keeps
one in reserve) and the trainer's forward and backward on the other, while the N recipe processes
(tokenizing, building datums, the SDK's HTTP) take their time from the same two cores. Once the
trainer is busy nearly all the time, more tenants add tokens only through bigger passes (a pass of
N tenants' datums costs less than N passes on CPU by little), so the curve flattens at what one core
trains per second. Measured so (2 groups x 4 samples, 3 steps, cores shared with other runs): one
client's step was 170 s, 120 s of it the train step and 30-58 s the save for the sampler, 2 s
sampling; the trainer was busy 98% of the span with one tenant and 99-100% with two, at 2.1 and
1.0-1.1 trained tokens/s: the trainer, not sampling, bounds it there.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

SAMPLED = "env/all/total_ac_tokens"


def arrival_stats(arrivals: list[tuple[float, str]]) -> dict:
    """Median and 90th-percentile gap from a forward_backward's arrival to the nearest other tenant's,
    and the median interval between one tenant's arrivals (its step time), in seconds."""
    by_model: dict[str, list[float]] = defaultdict(list)
    for arrived_s, model_id in arrivals:
        by_model[model_id].append(arrived_s)
    gaps_s = [min(abs(t - other) for other_id, times in by_model.items() if other_id != model_id for other in times)
              for model_id, times in by_model.items() for t in times if len(by_model) > 1]
    periods_s = [b - a for times in by_model.values() for a, b in zip(times, times[1:])]
    return {"gap_median_s": _quantile(gaps_s, 0.5), "gap_p90_s": _quantile(gaps_s, 0.9),
            "step_median_s": _quantile(periods_s, 0.5)}


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


def sampled_tokens(log_paths: list[Path]) -> int:
    """The recipes' sampled (action) tokens of steps 2 on, summed over tenants."""
    total = 0
    for log_path in log_paths:
        metrics = log_path / "metrics.jsonl"
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] \
            if metrics.is_file() else []
        total += sum(row.get(SAMPLED, 0) for row in rows[1:])
    return int(total)


def curve_row(tenants: int, scheduler, log_paths: list[Path], seconds: float) -> dict:
    """One N's row from its service's scheduler (after its clients finished) and its recipes' logs."""
    clock, passes = scheduler.clock, dict(scheduler.pass_sizes)
    span_s = clock.end_s - clock.start_s if clock.start_s is not None else 0.0
    shared = sum(count for size, count in passes.items() if size > 1)
    sampled = sampled_tokens(log_paths)
    return {"tenants": tenants, "seconds": round(seconds, 1), "train_span_s": round(span_s, 1),
            "passes": sum(passes.values()), "shared_passes": shared,
            "pass_sizes": {str(size): count for size, count in sorted(passes.items())},
            "multi_tenant_pass_fraction": round(shared / max(1, sum(passes.values())), 3),
            "trained_tokens": scheduler.trained_tokens, "sampled_tokens": sampled,
            "trained_tokens_per_s": round(scheduler.trained_tokens / span_s, 1) if span_s else 0.0,
            "sampled_tokens_per_s": round(sampled / span_s, 1) if span_s else 0.0,
            "trainer_busy_fraction": round(clock.busy_fraction(), 3),
            "trainer_busy_s_by_job": {name: round(s, 1) for name, s in clock.busy_by_job_s.most_common()},
            **arrival_stats(list(scheduler.arrivals))}


def curve_summary(rows: list[dict]) -> dict:
    """The keys `--json` carries for the curve: at the largest N, its trained tokens/s over one
    tenant's (None without an N=1 row), its shared-pass and trainer-busy fractions; and every row."""
    largest = max(rows, key=lambda row: row["tenants"])
    single = next((row for row in rows if row["tenants"] == 1), None)
    ratio = (round(largest["trained_tokens_per_s"] / single["trained_tokens_per_s"], 2)
             if single and single["trained_tokens_per_s"] else None)
    return {"aggregate_over_single": ratio, "multi_tenant_pass_fraction": largest["multi_tenant_pass_fraction"],
            "trainer_busy_fraction": largest["trainer_busy_fraction"], "curve": rows}


def plot_curve(rows: list[dict], title: str, path: Path) -> Path:
    """Trained and sampled tokens/s (left axis) and the busy and shared-pass fractions (right) vs N."""
    from graft.bench.common import pyplot, save_figure  # torch and vLLM's client: only once there is a plot

    rows = sorted(rows, key=lambda row: row["tenants"])
    tenants = [row["tenants"] for row in rows]
    fig, ax = pyplot().subplots(figsize=(7, 4.5))
    ax.plot(tenants, [row["trained_tokens_per_s"] for row in rows], "o-", label="trained tokens/s")
    ax.plot(tenants, [row["sampled_tokens_per_s"] for row in rows], "s-", label="sampled tokens/s")
    ax.set_xscale("log", base=2)
    ax.set_xticks(tenants, [str(n) for n in tenants])
    ax.set_xlabel("tenants (one recipe process each)")
    ax.set_ylabel("tokens per second, all tenants")
    ax.set_ylim(bottom=0)
    right = ax.twinx()
    right.plot(tenants, [row["trainer_busy_fraction"] for row in rows], "^--", color="tab:red",
               label="trainer busy fraction")
    right.plot(tenants, [row["multi_tenant_pass_fraction"] for row in rows], "v--", color="tab:purple",
               label="passes holding >= 2 tenants")
    right.set_ylim(0, 1.05)
    right.set_ylabel("fraction")
    handles = ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)
