"""`make gpu-check`: prove graft on one CUDA GPU in at most 10 minutes, with a pass/fail table.

A GPU box usually has its own torch, transformers and peft: this runs graft from the source tree
with the interpreter it is started with and installs only the packages that interpreter lacks (from
`--wheels DIR` when given, for machines without internet, else from PyPI) into a private folder.

Checks, in order (each one a fresh process, so one failure never hides the next):
- `gpu tests`: the tests marked `gpu` (`pytest -m gpu` over the files that hold them).
- `train MODE DTYPE POLICY`: `graft train` for a few steps on a tiny model, with the in-process
  reference engine on the GPU, in each sync mode (adapter, merged), fp32 and bf16, on-policy and
  `max_staleness: 1`; each run's sync must be verified (the engine's log-probs of the new version
  match the trainer's within `sync.verify`'s tolerance, or the run fails).
- `resume`: a run stopped after its checkpoint goes on with `--resume` to the end.
- `export`: the trained adapter merged into a standalone model, which then loads.
- `vllm smoke`, `vllm MODE bfloat16`: where a CUDA vLLM is importable (`--vllm-site DIR`:
  scripts/gpu_vllm_install.sh puts one there on a box without internet), its imports and graft's command
  line for it (scripts/gpu_vllm_smoke.py, seconds), then `graft train` against the vLLM server graft
  launches on the same GPU, in each sync mode.
- `update bench`: one GRPO update at the Qwen2.5-0.5B shape (`graft bench update`); with
  `--update-sweep` also graft's update in the settings of `UPDATE_SWEEP`, side by side, and a profile
  of each (a few minutes more: beyond the ten).

`--out DIR` keeps every check's log and writes gpu-check.json and gpu-check.md (the table); `--bundle
FILE` packs those, the logs and the profiles into one .tar.gz.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# import name -> pip requirement: graft's own dependencies that a GPU box's image may lack.
NEEDED = {"pydantic": "pydantic>=2.12", "yaml": "pyyaml>=6", "httpx": "httpx>=0.27", "rich": "rich>=13",
          "safetensors": "safetensors>=0.6.2", "peft": "peft>=0.18", "transformers": "transformers>=5.16",
          "matplotlib": "matplotlib>=3.8", "tensorboard": "tensorboard>=2.16", "pyarrow": "pyarrow>=15",
          "gguf": "gguf>=0.17", "pytest": "pytest>=8"}
MODES = ("adapter", "merged")
DTYPES = ("float32", "bfloat16")
STALENESS = (0, 1)
# `--update-sweep`: the update's settings a GPU should choose among (`graft bench update --variant`);
# graft's defaults are the bench's own "graft" side (on CUDA, micro-batches and head chunks sized by the
# free memory: graft/train/memory_budget.py). "fixed-8k": the sizes before that (8192-token micro-batches,
# 64 MiB head chunks: 110 positions at the bench's vocabulary).
UPDATE_SWEEP = ("fixed-8k:train.max_tokens_per_micro_batch=8192,train.logit_chunk_tokens=110",
                "lora-fp32:train.lora_compute_dtype=float32", "compiled:train.compile=true",
                "tokens-32k:train.max_tokens_per_micro_batch=32768", "head-8k:train.logit_chunk_tokens=8192")


def gpu_test_files() -> list[Path]:
    """The test files that hold `gpu` tests: collecting the whole suite on a GPU box imports modules its
    image lacks (the Tinker API's tests import `tinker`; uvicorn), and each such error failed the check."""
    return sorted(path for path in (ROOT / "tests").rglob("test_*.py") if "mark.gpu" in path.read_text())


def install_missing(site: Path, wheels: Path | None) -> list[str]:
    """pip-install into `site` what this interpreter cannot import; returns the requirements installed."""
    missing = [req for name, req in NEEDED.items() if importlib.util.find_spec(name) is None]
    if wheels is not None:  # offline: every carried wheel, whether or not a package above names it
        command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site),
                   *map(str, sorted(wheels.glob("*.whl")))]
    elif missing:
        command = [sys.executable, "-m", "pip", "install", "-q", "--target", str(site), *missing]
    else:
        return []
    subprocess.run(command, check=True)
    return missing


class Checks:
    """Runs each check as a subprocess in `work`, logs it to `logs/`, and collects the table's rows."""

    def __init__(self, work: Path, env: dict, timeout_s: float) -> None:
        self.work, self.env, self.timeout_s = work, env, timeout_s
        (work / "logs").mkdir(parents=True, exist_ok=True)
        self.rows: list[dict] = []

    def run(self, name: str, argv: list[str], judge=None, timeout_s: float | None = None) -> dict:
        """One check: passed when `argv` exits 0 and `judge()` (if any) returns a detail without raising."""
        log = self.work / "logs" / (name.replace(" ", "-") + ".log")
        start = time.monotonic()
        try:
            code = _run_logged(argv, self.work, self.env, log, timeout_s or self.timeout_s)
            detail = _last_line(log) if code else (judge() if judge else "")
            status = "pass" if code == 0 else "FAIL"
        except subprocess.TimeoutExpired:
            status, detail = "FAIL", f"timed out after {timeout_s or self.timeout_s:.0f} s (stacks in {log.name})"
        except Exception as error:  # noqa: BLE001 - a judge's finding is the check's result
            status, detail = "FAIL", f"{type(error).__name__}: {error}"
        row = {"check": name, "status": status, "seconds": round(time.monotonic() - start, 1), "detail": detail}
        print(f"{status:4}  {row['seconds']:6.1f} s  {name}  {detail}", flush=True)
        self.rows.append(row)
        return row


def _run_logged(argv: list[str], cwd: Path, env: dict, log: Path, timeout_s: float) -> int:
    """`argv`'s exit code, its output in `log`. On a timeout it gets SIGABRT first: with
    PYTHONFAULTHANDLER set, Python writes every thread's stack to the log before it dies."""
    with log.open("w") as out:
        process = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            return process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGABRT)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
            raise


def _last_line(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no output)"


def graft(*args: str) -> list[str]:
    return [sys.executable, "-m", "graft.cli", *args]


# Where the checks run: the GPU, or (`--allow-cpu`, to try the script itself on a machine without one) the CPU.
DEVICE = "cuda"


def train_args(base: Path, run_dir: Path, mode: str, dtype: str, staleness: int, steps: int) -> list[str]:
    overrides = {"model.path": base, "model.dtype": dtype, "rollout.engine": "reference",
                 "rollout.reference_device": DEVICE, "rollout.max_staleness": staleness, "rollout.n_samples": 4,
                 "rollout.max_new_tokens": 8, "sync.mode": mode, "sync.verify": "true", "train.steps": steps,
                 "train.batch_prompts": 4, "train.eval_every": 0, "train.eval_examples": 4, "train.checkpoint_every": 1}
    return graft("train", "--run-dir", str(run_dir), *[f"-o{key}={value}" for key, value in overrides.items()])


def judge_train(run_dir: Path, steps: int):
    """A run's table detail: every step present and synced; the trainer-vs-engine gap and sync time."""
    def judge() -> str:
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in metrics] == list(range(1, steps + 1)), "steps missing from metrics.jsonl"
        gaps = [m["sync_logprob_abs_diff_max"] for m in metrics if m.get("sync_logprob_abs_diff_max") is not None]
        assert gaps, "no verified sync in metrics.jsonl"
        sync_s = sum(m["sync_seconds"] for m in metrics) / len(metrics)
        return f"gap max {max(gaps):.1e}, sync {sync_s:.3f} s/step, step {metrics[-1]['step_seconds']:.2f} s"
    return judge


def run_train_grid(checks: Checks, base: Path, steps: int, parallel: int) -> None:
    """The 8 runs side by side: tiny models leave the GPU mostly idle, start-up (imports) dominates."""
    grid = [(m, d, s) for m in MODES for d in DTYPES for s in STALENESS]

    def one(point):
        mode, dtype, staleness = point
        run_dir = checks.work / f"run-{mode}-{dtype}-s{staleness}"
        name = f"train {mode} {dtype} {'on-policy' if staleness == 0 else 'staleness 1'}"
        return checks.run(name, train_args(base, run_dir, mode, dtype, staleness, steps), judge_train(run_dir, steps))

    with ThreadPoolExecutor(parallel) as pool:
        list(pool.map(one, grid))


def run_resume_and_export(checks: Checks, base: Path, steps: int) -> None:
    run_dir = checks.work / "run-resume"
    first = train_args(base, run_dir, "adapter", "bfloat16", 0, steps)
    checks.run("resume (first part)", first, judge_train(run_dir, steps))
    checks.run("resume", [*first, f"-otrain.steps={steps + 2}", "--resume"], judge_train(run_dir, steps + 2))
    adapters = sorted((run_dir / "weights").glob("adapter-v*[0-9]"))
    out = checks.work / "exported"
    checks.run("export", graft("export", "--base", str(base), "--adapter", str(adapters[-1] if adapters else run_dir),
                               "--out", str(out), "--dtype", "bfloat16"), lambda: _loads(out))


def run_vllm(checks: Checks, base: Path, steps: int, site: Path | None) -> None:
    """`graft train` against a CUDA vLLM graft launches on the same GPU (bf16, both sync modes):
    graft's launcher, entry module and patches on a CUDA build (scripts/gpu_vllm_wheels.py). First the
    seconds-long smoke check (scripts/gpu_vllm_smoke.py): where it fails, the runs would fail the same
    way minutes later, and are not started."""
    smoke_log = checks.work / "logs" / "vllm-smoke.log"
    smoke = checks.run("vllm smoke", [sys.executable, str(ROOT / "scripts" / "gpu_vllm_smoke.py"),
                                      *([str(site)] if site else [])], lambda: _last_line(smoke_log), timeout_s=120)
    if smoke["status"] != "pass":
        return
    for mode in MODES:
        run_dir = checks.work / f"run-vllm-{mode}"
        argv = [*train_args(base, run_dir, mode, "bfloat16", 0, steps), "-orollout.engine=vllm",
                "-orollout.gpu_memory_utilization=0.3"]
        checks.run(f"vllm {mode} bfloat16", argv, judge_train(run_dir, steps), timeout_s=420)


def judge_update(result_json: Path):
    """The update bench's table detail: each side's seconds and share of the device's peak, and graft's
    tokens/s over TRL's."""
    def judge() -> str:
        sides = json.loads(result_json.read_text())["sides"]
        parts = [f"{name} {side['seconds']:.2f} s" + (f" ({side['peak_fraction']:.1%} of peak)"
                                                      if side.get("peak_fraction") else "")
                 for name, side in sides.items()]
        if "graft" in sides and "trl" in sides:
            ratio = sides["graft"]["tokens_per_second"] / sides["trl"]["tokens_per_second"]
            parts.append(f"graft/TRL tokens/s {ratio:.2f}x")
        return ", ".join(parts)
    return judge


def _loads(model_dir: Path) -> str:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).to(DEVICE)
    return f"{sum(p.numel() for p in model.parameters()):,} parameters on {next(model.parameters()).device}"


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "gpu-check")
    parser.add_argument("--wheels", type=Path, help="install missing packages from these wheels (no internet)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--parallel", type=int, default=4, help="train runs side by side (default 4)")
    parser.add_argument("--skip", default="", help="comma-separated: tests,train,resume,vllm,bench")
    parser.add_argument("--vllm-site", type=Path, help="a folder holding a CUDA vLLM (scripts/gpu_vllm_install.sh)")
    parser.add_argument("--bench-args", default="", help="extra arguments for `graft bench update`")
    parser.add_argument("--update-sweep", action="store_true",
                        help="the update bench also in UPDATE_SWEEP's settings, each profiled (minutes more)")
    parser.add_argument("--timeout", type=float, default=150, help="seconds per train/resume/export check")
    parser.add_argument("--bundle", type=Path, help="also pack the table, the JSON, the logs and the profiles into "
                        "this .tar.gz (what a GPU machine hands back is a few files)")
    parser.add_argument("--allow-cpu", action="store_true", help="without a GPU, run the checks on the CPU")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(argv)
    skip = set(filter(None, args.skip.split(",")))
    args.out.mkdir(parents=True, exist_ok=True)
    site = args.out / "site"
    installed = install_missing(site, args.wheels)
    paths = [str(ROOT), str(site), *([str(args.vllm_site)] if args.vllm_site else [])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")]),
           "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
    sys.path[:0] = paths
    import torch

    global DEVICE
    if not torch.cuda.is_available():
        if not args.allow_cpu:
            print("graft: error: gpu-check needs a CUDA GPU: torch.cuda.is_available() is False", file=sys.stderr)
            return 2
        DEVICE = "cpu"
    name = torch.cuda.get_device_name(0) if DEVICE == "cuda" else f"CPU ({os.cpu_count()} cores)"
    device = f"{name}, torch {torch.__version__}"
    print(f"gpu-check on {device}; installed: {', '.join(installed) or 'nothing'}", flush=True)
    started = time.monotonic()
    checks = Checks(args.out, env, timeout_s=args.timeout)
    if "tests" not in skip:
        checks.run("gpu tests", [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-rs",
                                 *map(str, gpu_test_files())], timeout_s=300)
    base = args.out / "tiny-base"
    if not base.exists():
        checks.run("tiny model", graft("tiny-model", str(base), "--hidden", "128", "--layers", "2"))
    # The train grid and resume/export side by side: tiny models leave the GPU idle; on the H100 the
    # grid took 55 s and resume/export 103 s after it, mostly processes importing torch.
    with ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(run_train_grid, checks, base, args.steps, args.parallel)] if "train" not in skip else []
        if "resume" not in skip:
            runs.append(pool.submit(run_resume_and_export, checks, base, args.steps))
        for run in runs:
            run.result()
    if "vllm" not in skip and (DEVICE == "cuda" or args.vllm_site) and importlib.util.find_spec("vllm") is not None:
        run_vllm(checks, base, args.steps, args.vllm_site)
    if "bench" not in skip:
        sweep = [f"--variant={v}" for v in UPDATE_SWEEP] + ["--profile", str(args.out / "update-profile")]
        checks.run("update bench", graft("bench", "update", "--json", str(args.out / "update.json"),
                                         *args.bench_args.split(), *(sweep if args.update_sweep else [])),
                   judge_update(args.out / "update.json"), timeout_s=600 if args.update_sweep else 360)
    code = report(checks.rows, device, time.monotonic() - started, args.out)
    if args.bundle:
        bundle(args.out, args.bundle)
    return code


def report(rows: list[dict], device: str, seconds: float, out: Path) -> int:
    failed = [row["check"] for row in rows if row["status"] != "pass"]
    table = ["| check | result | s | detail |", "|---|---|---|---|"]
    table += [f"| {r['check']} | {r['status']} | {r['seconds']} | {r['detail']} |" for r in rows]
    verdict = f"{len(rows) - len(failed)} of {len(rows)} checks passed in {seconds:.0f} s on {device}"
    (out / "gpu-check.md").write_text("\n".join([verdict, "", *table, ""]))
    (out / "gpu-check.json").write_text(json.dumps({"device": device, "seconds": seconds, "checks": rows}, indent=1))
    print("\n" + "\n".join(table) + f"\n\n{verdict}")
    return 1 if failed else 0


def bundle(out: Path, archive: Path) -> None:
    """The results of `out` in one .tar.gz: tables, JSON, logs, profiles; not the installed packages, the
    tiny model or the runs' weights."""
    archive.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "w:gz") as tar:
        for path in sorted(out.iterdir()):
            if path.suffix in (".md", ".json") or path.name in ("logs", "update-profile"):
                tar.add(path, arcname=path.name)


if __name__ == "__main__":
    sys.exit(main())
