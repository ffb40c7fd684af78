"""`graft bench update`: the JSON each side writes (tokens, seconds, memory, FLOPs, the device), the
profile table, the flags it refuses, and the FLOP count's parameters. Real runs at a tiny shape."""

import json

import pytest
import torch

from graft.bench import update
from graft.bench.update_measure import build_base, non_embedding_parameters, useful_flops
from graft.cli import main
from graft.lora.attach import attach_lora, lora_parameters
from graft.train.memory_budget import MIN_AUTO_TOKENS

TINY_DIMS = {"hidden": 64, "intermediate": 128, "heads": 4, "kv_heads": 2, "vocab": 500}
TINY_FLAGS = ["--layers", "2", "--sequences", "8", "--prompt-tokens", "6", "--completion-tokens", "4",
              "--device", "cpu", "--repeats", "1"]
# peak_bytes is not here: on the CPU it is the resident peak above the model's, which is 0 when building
# the model peaked higher than the update (ru_maxrss never resets); it is checked to be >= 0.
NUMBERS = ("seconds", "cpu_seconds", "tokens", "tokens_per_second", "tokens_per_cpu_second", "model_bytes",
           "useful_flops", "useful_tflops")


def _bench(monkeypatch, tmp_path, *flags: str) -> dict:
    monkeypatch.setattr(update, "DIMS", TINY_DIMS)
    out = tmp_path / "update.json"
    assert main(["bench", "update", *TINY_FLAGS, "--json", str(out), *flags]) == 0
    return json.loads(out.read_text())


def test_graft_side_writes_the_json_contract_and_a_profile(monkeypatch, tmp_path):
    result = _bench(monkeypatch, tmp_path, "--sides", "graft", "--profile", str(tmp_path / "profile"))
    assert result["device"].startswith("cpu (") and result["device"].endswith(" cores)")
    assert list(result["sides"]) == ["graft"] and result["dtype"] == "float32" and result["peak_tflops"] is None
    graft = result["sides"]["graft"]
    assert all(graft[key] > 0 for key in NUMBERS) and graft["peak_bytes"] >= 0, graft
    assert graft["tokens"] == 8 * (6 + 4)
    assert graft["tokens_per_second"] == pytest.approx(graft["tokens"] / graft["seconds"])
    assert graft["seconds"] == min(graft["all_seconds"]) and len(graft["all_seconds"]) == 1
    assert graft["optimizer_steps"] == 2  # the warm-up and the one timed update, one step each
    assert graft["peak_fraction"] is None and graft["lora_dtype"] == "float32"
    # auto sizes: the tiny model's micro-batches hold more than the least; the CPU's 64 MiB head chunks
    assert graft["micro_batch_tokens"] > MIN_AUTO_TOKENS and graft["logit_chunk_tokens"] is None
    table = (tmp_path / "profile" / "graft.txt").read_text()
    assert "Self CPU" in table and "aten::" in table
    assert not (tmp_path / "profile" / "trl.txt").exists()


def test_variants_add_graft_sides_with_their_settings(monkeypatch, tmp_path):
    result = _bench(monkeypatch, tmp_path, "--sides", "graft", "-o", "train.activation_checkpointing=false",
                    "--variant", "ckpt:train.activation_checkpointing=true, train.logit_chunk_tokens=3",
                    "--variant", "packed-off:train.pack_sequences=false", "--profile", str(tmp_path / "profile"))
    assert list(result["sides"]) == ["graft", "graft ckpt", "graft packed-off"]
    graft, ckpt = result["sides"]["graft"], result["sides"]["graft ckpt"]
    assert graft["overrides"] == ["train.activation_checkpointing=false"] and graft["checkpointed_layers"] == 0
    assert ckpt["overrides"] == ["train.activation_checkpointing=false", "train.activation_checkpointing=true",
                                 "train.logit_chunk_tokens=3"]
    assert ckpt["checkpointed_layers"] >= 2 and ckpt["tokens"] == graft["tokens"]  # both layers
    # without auto checkpointing's memory model, auto's least; a chunk size set is kept
    assert graft["micro_batch_tokens"] == ckpt["micro_batch_tokens"] == MIN_AUTO_TOKENS
    assert graft["logit_chunk_tokens"] is None and ckpt["logit_chunk_tokens"] == 3
    steps = {name: side["optimizer_steps"] for name, side in result["sides"].items()}
    assert steps == dict.fromkeys(result["sides"], 2)  # warm-up and timed; the profiled update not counted
    assert (tmp_path / "profile" / "graft-packed-off.txt").exists()


@pytest.mark.parametrize("variant", ["train.lr=1", "x:", ":train.lr=1", "x:train.no_such_key=1",
                                     "x:train.lora_compute_dtype=float16"])
def test_refuses_a_variant_without_a_name_or_with_a_bad_setting(monkeypatch, tmp_path, capsys, variant):
    out = tmp_path / "update.json"
    assert main(["bench", "update", *TINY_FLAGS, "--json", str(out), "--variant", variant]) == 2
    assert "--variant" in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize("flags, named", [(["--sides", "graft,vllm"], "--sides"), (["--sides", ""], "--sides"),
                                          (["--sequences", "12"], "--sequences")])
def test_refuses_unknown_sides_and_partial_groups(monkeypatch, tmp_path, capsys, flags, named):
    out = tmp_path / "update.json"
    assert main(["bench", "update", *TINY_FLAGS, "--json", str(out), *flags]) == 2
    assert named in capsys.readouterr().err and not out.exists()


def test_flops_count_every_weight_but_the_embedding_head_and_adapter():
    spec = {"dims": TINY_DIMS, "layers": 2, "dtype": "bfloat16", "sequences": 8, "prompt_tokens": 6,
            "completion_tokens": 4}
    h, i, kv = 64, 128, 64 // 4 * 2
    per_layer = (h * h + h) + 2 * (h * kv + kv) + h * h + 3 * h * i + 2 * h  # q, k, v (biased), o, MLP, norms
    model = build_base(spec)
    assert non_embedding_parameters(model) == 2 * per_layer + h  # + the final norm
    model = attach_lora(model, rank=16, alpha=32, seed=0)
    assert non_embedding_parameters(model) == 2 * per_layer + h
    # A bf16 base keeps an fp32 adapter.
    assert {p.dtype for p in lora_parameters(model).values()} == {torch.float32}
    assert model.get_base_model().model.layers[0].mlp.up_proj.base_layer.weight.dtype == torch.bfloat16
    flops = useful_flops(spec, non_embedding_parameters(model))
    assert flops == 4 * (2 * per_layer + h) * 8 * 10 + 4 * h * 500 * 8 * 4


@pytest.mark.trl
def test_both_sides_update_the_same_batch(monkeypatch, tmp_path):
    result = _bench(monkeypatch, tmp_path, "--profile", str(tmp_path / "profile"))
    assert set(result["sides"]) == {"graft", "trl"}
    graft, trl = result["sides"]["graft"], result["sides"]["trl"]
    assert graft["tokens"] == trl["tokens"] == 80
    assert all(trl[key] > 0 for key in NUMBERS) and trl["peak_bytes"] >= 0, trl
    assert trl["optimizer_steps"] == 3  # warm-up, timed, profiled
    assert graft["non_embedding_parameters"] == trl["non_embedding_parameters"]
    assert "aten::" in (tmp_path / "profile" / "trl.txt").read_text()
    # graft-settings copy graft's choice in this run: the tiny model's whole batch in one micro-batch,
    # no layer checkpointed
    assert graft["checkpointed_layers"] == 0 and graft["micro_batch_tokens"] >= 80
    assert trl["micro_batch_rows"] == 8 and trl["gradient_checkpointing"] is False


@pytest.mark.trl
def test_trl_copies_the_sizes_of_grafts_side_in_the_same_run(monkeypatch, tmp_path):
    """With every layer checkpointed and 40-token micro-batches on graft's side, TRL's graft-settings
    checkpoint too and take 4 of the 10-token rows per micro-batch."""
    result = _bench(monkeypatch, tmp_path, "-o", "train.activation_checkpointing=true",
                    "-o", "train.max_tokens_per_micro_batch=40")
    graft, trl = result["sides"]["graft"], result["sides"]["trl"]
    assert graft["micro_batch_tokens"] == 40 and graft["checkpointed_layers"] == 2
    assert trl["micro_batch_rows"] == 4 and trl["gradient_checkpointing"] is True


def test_a_side_that_fails_is_named_and_fails_the_command_after_the_others_are_measured(monkeypatch, tmp_path,
                                                                                         capsys):
    """A TRL worker that cannot start (on a GPU box: a package its image lacks) must not leave a run
    that exits 0 with graft's side alone: the command exits 1 naming the side, the JSON says why."""
    def trl_cannot_start(spec, work, console):
        raise RuntimeError("the TRL run failed (exit 1); last lines: ModuleNotFoundError: No module named 'xxhash'")

    monkeypatch.setattr(update, "DIMS", TINY_DIMS)
    monkeypatch.setattr(update, "measure_trl", trl_cannot_start)
    out = tmp_path / "update.json"
    assert main(["bench", "update", *TINY_FLAGS, "--json", str(out)]) == 1
    result = json.loads(out.read_text())
    assert list(result["sides"]) == ["graft"]
    assert result["failed"] == {"trl": "the TRL run failed (exit 1); last lines: ModuleNotFoundError: No module "
                                       "named 'xxhash'"}
    assert "graft bench update: failed: trl (why: above)" in capsys.readouterr().err
