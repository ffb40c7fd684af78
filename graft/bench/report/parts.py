"""The result tables of the benches that measure one part of a step: sync and its sweeps, the
delivery check, merge, rollout, the soak, one step at a real shape, one update (memory and time) and
the tenants. As in `graft.bench.report.runs`, each renderer reads only what its bench writes."""

from __future__ import annotations

from graft.bench.report.markdown import gib, mib, small, table

SYNC_MODES = {
    "adapter": "adapter (disk: PEFT files, load `<name>-vN`, unload old)",
    "adapter_publish": "adapter publish only",
    "adapter-memory": "adapter-memory (blob in the HTTP body)",
    "adapter-memory-shm": "adapter-memory-shm (blob in a shared-memory segment)",
    "merged": "merged (fp32 merge into new tensors + reload)",
    "full": "full (a full fine-tune's weights + reload)",
    "raw_write": "raw write (floor of disk)",
}


def sync(kept: list[dict]) -> list[str]:
    """Each sync mode's seconds, when the new version is servable, its bytes, and its seconds over disk's."""
    rows = []
    for run in kept:
        disk = {row["model"]: row["seconds"] for row in run["result"]["rows"] if row["mode"] == "adapter"}
        rows += [[row["model"], SYNC_MODES.get(row["mode"], row["mode"]), f"{row['seconds']:.3f}",
                  f"{row['servable_seconds']:.3f}" if "servable_seconds" in row else "", mib(row["bytes"]),
                  f"{row['seconds'] / disk[row['model']]:.2f}"] for row in run["result"]["rows"]]
    return table(["model", "mode", "seconds", "servable after", "MiB", "x adapter"], rows)


def sync_stall(kept: list[dict]) -> list[str]:
    """Inter-token gaps of requests decoding on the previous version while new ones are synced."""
    rows = [[row["transport"], f"{1000 * row['median_gap_s']:.1f} ms", f"{1000 * row['max_gap_during_sync_s']:.1f} ms",
             f"{row['ratio']:.2f}"] for run in kept for row in run["result"]["rows"]]
    return table(["transport", "median gap", "largest gap overlapping a sync", "ratio (target <= 2)"], rows)


def sync_sweep(kept: list[dict]) -> list[str]:
    """Adapter and merged sync against their raw-write floors, per model size and per LoRA rank."""
    rows = []
    for run in kept:
        points: dict[tuple, dict[str, dict]] = {}
        for row in run["result"]["rows"]:
            points.setdefault((row["model"], row["rank"]), {})[row["mode"]] = row
        for (model, rank), m in points.items():
            size = f", {m['adapter']['params'] / 1e6:.3g}M" if run["result"]["sweep"] == "size" else ""
            rows.append([f"{model}{size}, r{rank}", f"{m['adapter']['bytes'] / 2**20:.2f}",
                         *(f"{m[mode]['seconds']:.3g}" for mode in ("adapter", "adapter_publish", "raw_write")),
                         f"{m['adapter']['seconds'] / m['raw_write']['seconds']:.2f}x",
                         f"{m['merged']['bytes'] / 2**20:.3g}",
                         *(f"{m[mode]['seconds']:.3g}" for mode in ("merged", "merged_raw_write")),
                         f"{m['merged']['seconds'] / m['merged_raw_write']['seconds']:.1f}x"])
    return table(["point", "adapter MiB", "adapter sync s", "publish only s", "raw write s", "adapter / floor",
                  "merged MiB", "merged sync s", "raw write s", "merged / floor"], rows)


def verify(kept: list[dict]) -> list[str]:
    """The quickstart's step with the delivery check on and off, a column per model, and one check at
    the 0.5B shape where the run measured it."""
    runs = [run["result"] for run in kept]
    rows = [[label, *(f"{r['quickstart'][key]:.3f}" for r in runs)] for label, key in (
        ("quickstart step, check on (s)", "step_seconds_check_on"),
        ("quickstart step, check off (s)", "step_seconds_check_off"),
        ("the check's own seconds", "check_seconds"))]
    rows.append(["step cost of the check", *(f"**{100 * r['quickstart']['step_cost_fraction']:+.1f}%**" for r in runs)])
    rows.append(["one check at the Qwen2.5-0.5B shape (s)",
                 *(f"{r['shape']['check_seconds']:.3f}" if "shape" in r else "" for r in runs)])
    return table(["", *(f"quickstart of {r['quickstart']['model']}" for r in runs)], rows)


def merge(kept: list[dict]) -> list[str]:
    """graft's merge and PEFT's merge_adapter(): median seconds, and what each leaves in the base."""
    lines = []
    for run in kept:
        r = run["result"]
        lines += table(["", "median seconds", f"base drift after {r['cycles']} merge cycles"],
                       [["graft (new tensors, fp32 math)", f"{r['graft_seconds']:.3f}", small(r["graft_base_drift"])],
                        ["PEFT `merge_adapter()` (in place)", f"{r['peft_seconds']:.3f}",
                         small(r["peft_bf16_drift_after_cycles"])]])
        lines += ["", f"{r['model']}, r={r['lora_rank']} on {r['lora_modules']} modules, medians of {r['repeats']} "
                      f"interleaved runs: PEFT / graft **{r['ratio']:.2f}x**."]
    return lines


ROLLOUT_MODES = {"base": "base weights", "adapter": "adapter, graft's LoRA ops",
                 "adapter_vllm_ops": "adapter, vLLM's LoRA ops", "merged": "merged weights (reloaded)"}


def rollout(kept: list[dict]) -> list[str]:
    """Generated tokens/s of one vLLM server through base weights, an adapter, 8 adapters mixed in one
    batch (results from before that mode show none) and merged weights: one column per model."""
    results = [run["result"] for run in kept]
    modes = {**ROLLOUT_MODES, "mixed_adapters": f"{results[0].get('mixed_adapters', 8)} adapters mixed in one batch"}
    lines = table(["served as", *(r["model"] for r in results)],
                  [[label, *(f"{r[f'{mode}_tokens_per_s']:.0f}" if f"{mode}_tokens_per_s" in r else "-"
                             for r in results)] for mode, label in modes.items()])
    for r in results:
        mixed = f", **{r['mixed_vs_base']:.2f}x** through {r.get('mixed_adapters', 8)} mixed" if "mixed_vs_base" in r else ""
        lines += ["", f"{r['model']}, LoRA r={r['lora_rank']}, {r['prompts']} prompts x {r['samples']} samples x "
                      f"{r['max_new_tokens']} tokens, medians of {r['repeats']} rounds: graft's ops "
                      f"**{r['grouped_vs_vllm_ops']:.2f}x** vLLM's; **{r['adapter_vs_base']:.2f}x** the base rate "
                      f"through one adapter{mixed}; merged {r['merged_vs_adapter']:.2f}x the adapter's."]
    return lines


def soak(kept: list[dict]) -> list[str]:
    """What a healthy soak shows: no failure, bounded adapters, nothing left, flat server memory."""
    rows = []
    for run in kept:
        r, rss = run["result"], run["result"]["server_rss_mib"]
        rows += [["adapter syncs, seconds", f"{r['cycles']} in {r['seconds']:.0f} s"],
                 [f"requests answered / failed ({r['concurrency']} streams)",
                  f"{r['requests_ok']:,} / {r['requests_failed']}"],
                 ["graft adapters on the server at most (keep_versions, max_loras)",
                  f"{r['max_adapters_loaded']} ({r['keep_versions']}, {r['max_loras']})"],
                 ["unload failures; adapters left loaded at the end",
                  f"{r['unload_failures']}; {len(r['left_loaded'])}"],
                 ["server RSS first / middle / last",
                  f"{rss['first']:.0f} / {rss['middle']:.0f} / {rss['last']:.0f} MiB"],
                 ["RSS growth over the second half", f"{r['rss_growth_second_half_mib']:+.1f} MiB"]]
    return table(["measured", "value"], rows)


def step(kept: list[dict]) -> list[str]:
    """One `graft train` step at a real shape: seconds per phase and peak resident memory."""
    rows = []
    for run in kept:
        r, s = run["result"], run["result"]["step"]
        rows += [[f"rollout: {s['rollout_tokens']:,} tokens",
                  f"{s['rollout_seconds']:.0f} s ({s['rollout_tokens'] / s['rollout_seconds']:.0f} tokens/s)"],
                 ["update (one optimizer step)", f"{s['train_seconds']:.0f} s"],
                 ["adapter sync + verification",
                  f"{s['sync_seconds']:.1f} s (gap {small(s['sync_logprob_abs_diff_max'])})"],
                 ["whole step", f"{s['step_seconds']:.0f} s"],
                 ["whole run (server start, two evaluations, the step)", f"{r['wall_seconds']:.0f} s"],
                 ["peak RSS: trainer / vLLM server / both", " / ".join(gib(r[f"{k}_peak_bytes"]) for k in
                                                                     ("trainer", "engines", "total"))]]
    return table(["phase", "seconds or peak"], rows)


TRL_CONFIGS = {"trl-defaults": "TRL, its defaults", "graft-settings": "TRL, graft's settings"}


def memory(kept: list[dict]) -> list[str]:
    """One update's peak memory above the model, seconds and CPU seconds: graft and TRL's two settings."""
    rows = []
    for s in (s for run in kept for s in run["result"]["shapes"]):
        graft = [f"**{gib(s['graft_above_model_bytes'])}** (model + LoRA {gib(s['graft_model_bytes'])})",
                 f"{s['graft_seconds']:.0f}", f"{s['graft_cpu_seconds']:.0f}"] \
            if s["graft_seconds"] is not None else ["failed", "", ""]  # a side that failed is None
        rows.append([f"{s['layers']} layers", f"{s['sequences']} sequences, {s['tokens']:,} tokens",
                     "**graft** (defaults)", *graft])
        for config, t in s["trl"].items():
            if t is None:
                rows.append(["", "", TRL_CONFIGS.get(config, config), "failed", "", ""])
                continue
            setting = f"{'checkpointing, ' if t['gradient_checkpointing'] else ''}" \
                      f"{t['gradient_accumulation_steps']} x {t['per_device_train_batch_size']} rows"
            rows.append(["", "", f"{TRL_CONFIGS.get(config, config)} ({setting})", gib(t["above_model_bytes"]),
                         f"{t['seconds']:.0f}", f"{t['cpu_seconds']:.0f}"])
    return table(["shape", "batch", "side", "peak above the model", "s", "CPU-s"], rows)


def _side_label(side: str, spec: dict) -> str:
    if side == "trl":
        return "TRL `GRPOTrainer` + PEFT"
    name = side.removeprefix("graft").strip()
    return f"graft `{', '.join(spec['variants'][name])}`" if name else "graft (defaults)"


def update(kept: list[dict]) -> list[str]:
    """One update per side on the recorded device: best of the timed updates."""
    rows, shapes = [], []
    for run in kept:
        r, spec = run["result"], run["result"]["spec"]
        shape = f"{spec['layers']} layers of the Qwen2.5-0.5B shape, {spec['sequences']} x ({spec['prompt_tokens']} " \
                f"+ {spec['completion_tokens']}) tokens, on {r['device']}"
        shapes += [shape] if shape not in shapes else []
        rows += [[r["dtype"], _side_label(side, spec), f"{s['seconds']:.2f}", f"{s['cpu_seconds']:.1f}",
                  f"{s['tokens'] / s['cpu_seconds']:.1f}", gib(s["above_model_bytes"])]
                 for side, s in r["sides"].items()]
    header = ["base", "side", "s", "CPU-s", "tokens/CPU-s", "peak above the model"]
    return [f"{'; '.join(shapes)}:", "", *table(header, rows)]


def tenants(kept: list[dict]) -> list[str]:
    """Tenants trained in shared batches vs one alone: tokens/s, batch-invariant tokens/s, isolation
    (invariant / default where the run measured both), memory added."""
    def invariant(r: dict) -> list[str]:
        if "invariant_tokens_per_s" not in r:  # kept from before `--batch-invariant` existed
            return ["-", small(r["isolation_max_rel_diff"])]
        return [f"{r['invariant_tokens_per_s']:.0f} tok/s ({r['invariant_over_together']:.2f}x)",
                f"{small(r['isolation_max_rel_diff'])} / {small(r['isolation_default_max_rel_diff'])}"]

    rows = [[f"hidden {r['hidden']}, {r['layers']} layers", str(r["tokens"]), f"{r['alone_tokens_per_s']:.0f} tok/s",
             f"{r['together_tokens_per_s']:.0f} tok/s ({r['tenants']})", f"{r['aggregate_over_single']:.2f}x",
             *invariant(r), f"{mib(r['tenant_state_bytes'])} / {mib(r['base_bytes'])} MiB"]
            for r in (run["result"] for run in kept)]
    return table(["base", "tokens per sequence", "1 tenant alone", "together (tenants)", "aggregate / alone",
                  "batch-invariant", "isolation: invariant / default", "tenants' state / base"], rows)


def placement(kept: list[dict]) -> list[str]:
    """A Tinker service's tenants on two vLLM servers, per layout: publish seconds, tokens/s with every
    tenant sampling and with one alone."""
    rows = [[f"{r['tenants']} tenants, cores {r['server_cores']}", label, f"{r[f'{layout}_publish_s']:.3f}",
             f"{r[f'{layout}_all_tokens_per_s']:.0f}", f"{r[f'{layout}_alone_tokens_per_s']:.0f}"]
            for r in (run["result"] for run in kept) for layout, label in r["layouts"].items()]
    return table(["servers", "layout", "publish s", "all tenants: tokens/s", "one tenant alone: tokens/s"], rows)


TABLES = {
    "sync": (("sync",), sync),
    "sync-stall": (("sync-stall",), sync_stall),
    "sync-sweep": (("sync-size", "sync-rank"), sync_sweep),
    "verify": (("verify", "verify-smollm2"), verify),
    "merge": (("merge",), merge),
    "rollout": (("rollout", "rollout-smollm2"), rollout),
    "soak": (("soak",), soak),
    "step": (("step",), step),
    "memory": (("memory-2", "memory-24"), memory),
    "update": (("update", "update-bf16", "update-fp32"), update),
    "tenants": (("tenants",), tenants),
    "placement": (("placement",), placement),
}
