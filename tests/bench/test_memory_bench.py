"""`graft bench memory`: both sides train on the same batch (same ids, same ragged lengths), TRL's
two configurations are what they claim (micro-batches, checkpointing against graft's defaults), and
the command writes one row per shape with graft's and TRL's numbers. Real runs are tiny shapes."""

import json
from collections import Counter

import pytest

from graft.bench import memory
from graft.bench.memory import SHAPES, run_memory_bench, worker_spec
from graft.bench.memory_shape import QWEN_SHAPE, memory_batch, trl_generation_batch, unpadded_rows
from graft.bench.trl.env import TrlEnvError, run_trl, trl_python
from graft.bench.trl.memory_worker import CONFIGS, trl_memory_arguments
from graft.cli import main
from graft.config import load_config
from graft.models.cache import default_cache_dir
from graft.train.memory_budget import MIN_AUTO_TOKENS
from graft.train.micro_batches import micro_batches
from graft.train.rollout_batch import RolloutBatch

TINY_DIMS = {"hidden": 64, "intermediate": 128, "heads": 4, "kv_heads": 2, "vocab": 500}
TINY = {"name": "tiny", "layers": 1, "sequences": 16, "prompt_tokens": 6, "completion_tokens": [10, 5]}


def test_trl_batch_holds_graft_rows_with_their_ragged_lengths():
    rows, rewards_PG = memory_batch(16, 500, 6, (10, 5))
    generation = trl_generation_batch(rows, rewards_PG)
    assert unpadded_rows(generation) == rows
    assert [len(c) for _, c in rows] == [10, 5] * 8 and all(len(p) == 6 for p, _ in rows)
    assert generation["completion_ids"].shape == (16, 10) and generation["prompt_mask"].all()
    assert generation["num_items_in_batch"].item() == sum(len(c) for _, c in rows)
    assert min(t for p, c in rows for t in p + c) >= 3  # never the pad id
    # Group-normalised advantages: zero mean within each group of 8.
    assert generation["advantages"].view(2, 8).mean(dim=1).abs().max() < 1e-6
    # The same seed gives the same batch (each side builds it in its own process).
    assert memory_batch(16, 500, 6, (10, 5))[0] == rows


def test_trl_configurations_take_one_step_over_the_batch_and_differ_as_stated():
    train = load_config(None, []).train
    for sequences in (32, 8):
        defaults = trl_memory_arguments("trl-defaults", sequences, 640, "out")
        graft_like = trl_memory_arguments("graft-settings", sequences, 640, "out")
        for args in (defaults, graft_like):
            assert args["per_device_train_batch_size"] * args["gradient_accumulation_steps"] == sequences
            assert args["max_steps"] == 1 and not args["bf16"] and args["num_generations"] == 8
        # TRL's defaults: its micro-batch of 8 and its gradient checkpointing (left unset = on).
        assert defaults["per_device_train_batch_size"] == 8 and "gradient_checkpointing" not in defaults
        # graft's settings: checkpointing on (graft's default, auto, checkpoints as its memory needs), as many
        # 640-token rows as graft's token budget holds among the sizes TRL accepts (divisors of the batch): 8.
        assert graft_like["gradient_checkpointing"] is True and train.activation_checkpointing == "auto"
        assert graft_like["per_device_train_batch_size"] == 8 and 8 * 640 <= MIN_AUTO_TOKENS
    rows, rewards_PG = memory_batch(32, QWEN_SHAPE["vocab"])
    plan = micro_batches(list(range(32)), RolloutBatch(rows, [[]] * 32, rewards_PG, 0, 0.0), train)
    assert [len(m) for m in plan] == [12, 12, 8]  # graft's own split of the same batch


def test_shapes_state_their_batch():
    assert [(s["layers"], s["sequences"]) for s in SHAPES] == [(2, 32), (24, 8)]
    spec = worker_spec(SHAPES[1])
    assert spec["dims"] == QWEN_SHAPE and spec["prompt_tokens"] == 128 and spec["completion_tokens"] == [512, 256]


def test_command_writes_graft_and_both_trl_configurations_per_shape(monkeypatch, tmp_path, capsys):
    def fake_trl(python, spec, config, work_dir):
        return {"config": config, "model_bytes": 10, "peak_bytes": 40 if config == "trl-defaults" else 30,
                "seconds": 3.0, "cpu_seconds": 5.0, "gradient_checkpointing": config == "trl-defaults",
                "per_device_train_batch_size": 8, "gradient_accumulation_steps": 4, "trl_version": "1.16.0"}

    monkeypatch.setattr(memory, "trl_python", lambda cache_dir, console: tmp_path / "python")
    monkeypatch.setattr(memory, "measure_graft",
                        lambda spec, overrides: {"model_bytes": 10, "peak_bytes": 20, "seconds": 2.0,
                                                 "cpu_seconds": 4.0, "tokens": 4096})
    monkeypatch.setattr(memory, "measure_trl", fake_trl)
    out = tmp_path / "memory.json"
    assert main(["bench", "memory", "--layers", "24", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["shapes"]
    assert (row["name"], row["layers"], row["vocab"], row["sequences"], row["tokens"]) == (
        "qwen2.5-0.5b-shape", 24, 151_936, 8, 4096)
    assert (row["graft_peak_bytes"], row["graft_above_model_bytes"], row["graft_seconds"]) == (20, 10, 2.0)
    assert (row["trl_peak_bytes"], row["trl_above_model_bytes"], row["trl_seconds"]) == (40, 30, 3.0)  # TRL's defaults
    assert (row["graft_cpu_seconds"], row["trl_cpu_seconds"]) == (4.0, 5.0)
    assert set(row["trl"]) == set(CONFIGS) and row["trl"]["graft-settings"]["above_model_bytes"] == 20
    progress = capsys.readouterr().err
    assert all(f"measuring {side} at qwen2.5-0.5b-shape (8 sequences, 4,096 tokens)" in progress
               for side in ("graft", "TRL (trl-defaults)", "TRL (graft-settings)"))


def test_graft_only_run_measures_a_tiny_shape_in_a_fresh_process():
    result = run_memory_bench(layers=(1,), with_trl=False, shapes=(TINY,), dims=TINY_DIMS)
    (row,) = result["shapes"]
    assert row["tokens"] == 16 * 6 + 8 * 10 + 8 * 5 and row["vocab"] == 500
    assert row["graft_peak_bytes"] >= row["graft_model_bytes"] > 0 and row["graft_seconds"] > 0
    assert row["graft_cpu_seconds"] > 0
    assert row["trl_peak_bytes"] is None and row["trl_seconds"] is None and row["trl"] == {}
    assert row["graft_activation_checkpointing"] is False  # graft's default, auto: a tiny shape's activations fit
    # The override reaches the model, set up as the trainer sets it up.
    (plain,) = run_memory_bench(layers=(1,), overrides=["train.activation_checkpointing=true"], with_trl=False,
                                       shapes=(TINY,), dims=TINY_DIMS)["shapes"]
    assert plain["graft_activation_checkpointing"] is True


@pytest.mark.trl
def test_trl_worker_trains_on_graft_batch(tmp_path):
    python = trl_python(default_cache_dir())
    rows, _ = memory_batch(16, 500, 6, (10, 5))
    for config in CONFIGS:
        spec = {**worker_spec(TINY, TINY_DIMS), "config": config, "echo_batch": True}
        result = run_trl(python, spec, tmp_path / config, module="graft.bench.trl.memory_worker")
        # Every row TRL's loss saw (shuffled, split into micro-batches) is one of graft's, each once.
        assert Counter(json.dumps(r) for r in result["batch"]) == Counter(json.dumps(list(r)) for r in rows)
        assert result["optimizer_steps"] == 1 and result["tokens"] == 216
        assert result["gradient_checkpointing"] is True  # TRL's default, and graft's
        assert result["peak_bytes"] >= result["model_bytes"] > 0 and result["seconds"] > 0 and result["cpu_seconds"] > 0


def test_a_killed_measurement_is_reported_and_the_others_still_run(monkeypatch, tmp_path, capsys):
    def trl_killed_for_graft_settings(python, spec, config, work_dir):
        if config == "graft-settings":
            raise TrlEnvError("the TRL run failed (exit -9)")
        return {"config": config, "model_bytes": 10, "peak_bytes": 40, "seconds": 3.0, "cpu_seconds": 5.0,
                "gradient_checkpointing": True,
                "per_device_train_batch_size": 8, "gradient_accumulation_steps": 4, "trl_version": "1.16.0"}

    monkeypatch.setattr(memory, "trl_python", lambda cache_dir, console: tmp_path / "python")
    monkeypatch.setattr(memory, "measure_graft",
                        lambda spec, overrides: {"model_bytes": 10, "peak_bytes": 20, "seconds": 2.0,
                                                 "cpu_seconds": 4.0, "tokens": 16_384})
    monkeypatch.setattr(memory, "measure_trl", trl_killed_for_graft_settings)
    result = run_memory_bench(layers=(2,))
    (row,) = result["shapes"]
    assert row["trl"]["graft-settings"] is None and row["trl_above_model_bytes"] == 30
    memory.print_memory_report(result)
    assert "TRL (graft-settings) failed: the TRL run failed (exit -9)" in capsys.readouterr().err


def test_a_real_model_point_measures_that_model_with_its_own_layers(base_dir, monkeypatch):
    """`--model NAME` measures the packaged model's own weights (here the suite's tiny base stands in)."""
    from transformers import AutoConfig

    import graft.models.packaged

    monkeypatch.setattr(graft.models.packaged, "packaged_model_dir", lambda name, log=None: base_dir)
    shapes, dims = memory.real_model_point("smollm2")
    config = AutoConfig.from_pretrained(base_dir)
    assert shapes == ({"name": "smollm2", "layers": config.num_hidden_layers, "sequences": 8},)
    assert dims == {"path": str(base_dir), "vocab": config.vocab_size}
    small = ({**shapes[0], "sequences": 8, "prompt_tokens": 6, "completion_tokens": [10, 5]},)
    (row,) = run_memory_bench(layers=(shapes[0]["layers"],), with_trl=False, shapes=small, dims=dims)["shapes"]
    assert row["vocab"] == config.vocab_size and row["graft_peak_bytes"] >= row["graft_model_bytes"] > 0
