"""`graft bench step` plumbing on a tiny model with the in-process reference engine (the real run,
24 layers on vLLM, takes ~20 minutes: docs/benchmarks.md): it runs one `graft train` step, reads the
phases from its metrics and measures the trainer's memory."""

import os
import subprocess
import sys

from graft.bench.step import _tree_rss, run_step_bench


def test_tree_rss_separates_the_root_from_its_children():
    child = subprocess.Popen([sys.executable, "-c", "import time; x = bytearray(200 * 2**20); time.sleep(30)"])
    try:
        for _ in range(100):
            root, below = _tree_rss(os.getpid())
            if below > 150 * 2**20:
                break
            subprocess.run(["sleep", "0.1"])
        assert root > 50 * 2**20 and below > 150 * 2**20  # this process with torch; the child's 200 MiB
    finally:
        child.kill()
        child.wait()


def test_one_step_reports_phases_and_peaks(base_dir):
    result = run_step_bench(base_dir, ["rollout.engine=reference", "rollout.max_new_tokens=4", "train.batch_prompts=2",
                                       "rollout.n_samples=2", "model.dtype=float32"])
    step = result["step"]
    assert step["step"] == 1 and step["rollout_tokens"] > 0
    assert 0 < step["train_seconds"] < step["step_seconds"] <= result["wall_seconds"]
    assert result["trainer_peak_bytes"] > 100 * 2**20 and result["engines_peak_bytes"] == 0
