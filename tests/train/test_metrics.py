"""MetricsLog: the run directory's metrics files, kept consistent with a resumed run's checkpoint."""

import json

import pytest

from graft.train import metrics
from graft.train.metrics import REQUIRED_KEYS, MetricsLog, read_jsonl


def _row(step: int, reward: float = 0.5) -> dict:
    return {**dict.fromkeys(REQUIRED_KEYS, 0.0), "step": step, "reward_mean": reward, "sync_mode": "adapter"}


def test_rows_and_evaluations_are_appended_as_json_lines_and_plotted(tmp_path):
    log = MetricsLog(tmp_path)
    log.add_eval(0, 0.25)
    for step in (1, 2):
        log.write(_row(step, reward=step / 10))
    log.add_eval(2, 0.5)
    log.close()
    assert [r["reward_mean"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0.1, 0.2]
    assert read_jsonl(tmp_path / "eval.jsonl") == [{"step": 0, "accuracy": 0.25}, {"step": 2, "accuracy": 0.5}]
    assert log.accuracy_at(0) == 0.25 and log.accuracy_at(2) == 0.5 and log.accuracy_at(1) is None
    assert (tmp_path / "reward.png").read_bytes().startswith(b"\x89PNG")
    assert any((tmp_path / "tensorboard").iterdir())


def test_the_plot_is_redrawn_at_most_every_plot_every_s_and_at_evaluations_and_close(tmp_path, monkeypatch):
    """Drawing reward.png is on the step's critical path (0.083 s here): rows in quick succession
    draw it once; an evaluation and the end of the run always draw it."""
    monkeypatch.setattr(metrics, "PLOT_EVERY_S", 3600.0)
    log = MetricsLog(tmp_path)
    drawn = []
    real_plot = log.plot
    monkeypatch.setattr(log, "plot", lambda: (drawn.append(len(log.rows)), real_plot()))
    for step in (1, 2, 3):
        log.write(_row(step))
    assert drawn == [1] and (tmp_path / "reward.png").is_file()
    log.add_eval(3, 0.5)
    log.write(_row(4))
    log.close()
    assert drawn == [1, 3, 4]
    monkeypatch.setattr(metrics, "PLOT_EVERY_S", 0.0)
    log = MetricsLog(tmp_path, keep_through_step=4)
    monkeypatch.setattr(log, "plot", lambda: drawn.append(len(log.rows)))
    log.write(_row(5))
    log.write(_row(6))
    assert drawn[-2:] == [5, 6]
    log.close()


def test_a_row_without_a_contract_key_is_refused(tmp_path):
    log = MetricsLog(tmp_path)
    row = _row(1)
    del row["sync_seconds"]
    with pytest.raises(AssertionError, match="sync_seconds"):
        log.write(row)
    log.close()
    assert read_jsonl(tmp_path / "metrics.jsonl") == []


def test_a_resumed_log_drops_steps_its_checkpoint_lacks(tmp_path):
    log = MetricsLog(tmp_path)
    for step in (1, 2, 3):
        log.write(_row(step))
        log.add_eval(step, step / 10)
    log.close()
    resumed = MetricsLog(tmp_path, keep_through_step=2)  # the checkpoint is at step 2; step 3 is redone
    resumed.write(_row(3, reward=0.9))
    resumed.close()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["reward_mean"]) for r in rows] == [(1, 0.5), (2, 0.5), (3, 0.9)]
    assert [e["step"] for e in read_jsonl(tmp_path / "eval.jsonl")] == [1, 2]


def test_read_jsonl_of_a_missing_file_is_empty_and_skips_blank_lines(tmp_path):
    assert read_jsonl(tmp_path / "absent.jsonl") == []
    (tmp_path / "m.jsonl").write_text(json.dumps({"a": 1}) + "\n\n")
    assert read_jsonl(tmp_path / "m.jsonl") == [{"a": 1}]
