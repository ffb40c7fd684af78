"""RUN_DIR/metrics.jsonl (one JSON object per optimizer step) and RUN_DIR/reward.png."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# The run-directory contract (ARCHITECTURE.md): every row has at least these keys.
REQUIRED_KEYS = (
    "step", "policy_version", "reward_mean", "reward_std", "loss", "kl", "entropy", "grad_norm", "sync_mode",
    "sync_seconds", "sync_bytes", "rollout_seconds", "rollout_tokens", "rollout_tokens_per_s", "train_seconds",
    "staleness_max", "engine_adapters_loaded", "logprob_abs_diff_max", "step_seconds",
)


class MetricsLog:
    """Appends rows to metrics.jsonl as they come, and redraws the reward curve."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self.rows: list[dict] = []
        self.evals: list[tuple[int, float]] = []  # (step, held-out accuracy)

    def write(self, row: dict) -> None:
        missing = [k for k in REQUIRED_KEYS if k not in row]
        assert not missing, f"metrics row lacks {missing}"
        self.rows.append(row)
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        self.plot()

    def add_eval(self, step: int, accuracy: float) -> None:
        self.evals.append((step, accuracy))
        self.plot()

    def plot(self) -> None:
        fig, ax = plt.subplots(figsize=(6.5, 3.8))
        if self.rows:
            steps = [r["step"] for r in self.rows]
            mean = [r["reward_mean"] for r in self.rows]
            std = [r["reward_std"] for r in self.rows]
            ax.plot(steps, mean, label="train reward (mean over samples)")
            ax.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.2)
        if self.evals:
            ax.plot(*zip(*self.evals), "o--", label="held-out accuracy (greedy)")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("reward / accuracy")
        ax.set_ylim(-0.05, 1.05)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right")
        fig.tight_layout()
        fig.savefig(self.run_dir / "reward.png", dpi=110)
        plt.close(fig)
