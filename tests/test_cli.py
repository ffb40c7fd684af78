import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from graft.cli import build_parser, main

COMMANDS = ["tiny-model", "export", "config", "bench", "train", "eval", "serve", "quickstart", "verify"]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_explains_itself(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([command, "--help"])
    assert exit_info.value.code == 0
    assert len(capsys.readouterr().out.splitlines()) > 3



def test_help_and_a_bad_setting_answer_before_torch_is_imported():
    """`graft --help`, each command's help and a bad setting answer in about a second: nothing on
    their way imports torch, peft or vLLM (the parser once imported the Tinker service's policy, and
    `graft train` its trainer before reading the config: 4.3 s of imports here before every refusal)."""
    code = ("import sys\nfrom graft.cli import main\n"
            "for argv in (['--help'], ['train', '--help'], ['tenants', 'serve', '--help'], ['bench', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "assert main(['train', '-o', 'train.no_such_key=1']) == 2\n"
            "print(sorted(m for m in ('torch', 'peft', 'vllm') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1] == "[]" and "unknown config key 'train.no_such_key'" in done.stderr


def test_bench_help_lists_the_benches_and_each_bench_shows_its_own_flags(capsys):
    from graft.bench.commands import BENCHES

    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    listing = capsys.readouterr().out
    assert all(f"  {name} " in listing for name in BENCHES)
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "merge", "--help"])
    merge_help = " ".join(capsys.readouterr().out.split())  # argparse wraps to the terminal's width
    assert exit_info.value.code == 0 and "graft bench merge" in merge_help and "(default 1024)" in merge_help
    with pytest.raises(SystemExit):
        main(["bench", "rollout", "--help"])
    rollout_help = " ".join(capsys.readouterr().out.split())
    assert "(default 256)" in rollout_help and "--cycles" not in rollout_help

def test_tiny_model_command_is_deterministic(tmp_path, capsys):
    assert main(["tiny-model", str(tmp_path / "a"), "--arch", "llama", "--hidden", "64", "--seed", "5"]) == 0
    assert main(["tiny-model", str(tmp_path / "b"), "--arch", "llama", "--hidden", "64", "--seed", "5"]) == 0
    assert "wrote llama tiny model" in capsys.readouterr().out
    a = AutoModelForCausalLM.from_pretrained(tmp_path / "a", dtype=torch.float32).state_dict()
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "b", dtype=torch.float32).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_bad_hidden_size_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["tiny-model", str(tmp_path / "m"), "--hidden", "48"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("graft: error: hidden=48")
    assert not (tmp_path / "m").exists()


def test_config_command_prints_resolved_config_and_saves_it(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("lora:\n  rank: 4\n")
    assert main(["config", str(config), "-o", "rollout.max_staleness=1", "--save", str(tmp_path / "out.yaml")]) == 0
    out = capsys.readouterr().out
    assert "rank: 4" in out and "max_staleness: 1" in out
    assert (tmp_path / "out.yaml").read_text() == out


def test_config_command_rejects_unknown_key_through_a_subprocess(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("lora:\n  rnak: 4\n")
    result = subprocess.run([sys.executable, "-m", "graft.cli", "config", str(config)],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"graft: error: unknown config key 'lora.rnak' (in {config})"]


def test_eval_reports_base_and_adapter_accuracy(base_dir, tmp_path, capsys):
    from graft.lora.adapter_io import save_adapter
    from tests.helpers import trained_like_peft_model

    save_adapter(trained_like_peft_model(base_dir), tmp_path / "adapter")
    common = ["-o", f"model.path={base_dir}", "-o", "rollout.engine=reference", "-o", "train.eval_examples=3",
              "-o", "rollout.max_new_tokens=3", "--run-dir", str(tmp_path / "run")]
    assert main(["eval", *common, "--json", str(tmp_path / "base.json")]) == 0
    assert main(["eval", *common, "--adapter", str(tmp_path / "adapter"), "--json", str(tmp_path / "lora.json")]) == 0
    out = capsys.readouterr().out
    assert "held-out accuracy of base model" in out and "held-out accuracy of adapter" in out
    base, lora = (json.loads((tmp_path / f).read_text()) for f in ("base.json", "lora.json"))
    assert base["examples"] == lora["examples"] == 3 and base["adapter"] is None
    assert lora["adapter"] == str(tmp_path / "adapter") and 0.0 <= lora["accuracy"] <= 1.0


def test_eval_of_a_directory_that_is_not_an_adapter_is_one_line(base_dir, tmp_path, capsys):
    (tmp_path / "junk").mkdir()
    code = main(["eval", "-o", f"model.path={base_dir}", "-o", "rollout.engine=reference", "--adapter",
                 str(tmp_path / "junk"), "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "junk" in err[0]


@pytest.mark.parametrize("command", ["eval", "train"])
def test_a_model_directory_without_config_json_is_one_line_before_any_server(base_dir, tmp_path, capsys, command):
    import shutil

    shutil.copytree(base_dir, tmp_path / "model")
    (tmp_path / "model" / "config.json").unlink()
    code = main([command, "-o", f"model.path={tmp_path / 'model'}", "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [f"graft: error: model directory {tmp_path / 'model'} has no config.json: a Hugging "
                                 "Face model directory holds its config.json next to the weights"]
    assert not (tmp_path / "run" / "logs").exists()  # no vLLM was launched


def test_a_packaged_model_s_name_is_a_model_path(tmp_path, capsys):
    """`-o model.path=smollm2` is the packaged model (converted once, cached): `graft config` takes it,
    and `graft train` reads the converted directory's config (SmolLM2's 9 attention heads refuse
    dist.tp=2) before any server starts, where it once answered `hf download smollm2`."""
    assert main(["config", "configs/smollm2-quickstart.yaml", "-o", "model.path=smollm2"]) == 0
    assert "path: smollm2" in capsys.readouterr().out
    code = main(["train", "-o", "model.path=smollm2", "-o", "dist.tp=2", "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("graft: error: dist.tp=2 does not divide the model's "
                                            "num_attention_heads (9)"), err
    assert not (tmp_path / "run").exists()


def test_a_hub_id_in_the_local_cache_runs_offline(base_dir, tmp_path):
    import os

    from tests.helpers import hf_cache_with

    hf_cache_with(tmp_path / "hub", "graft-test/tiny", base_dir)
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    common = [sys.executable, "-m", "graft.cli", "eval", "-o", "rollout.engine=reference",
              "-o", "train.eval_examples=2", "-o", "rollout.max_new_tokens=2", "--run-dir", str(tmp_path / "run")]
    done = subprocess.run([*common, "-o", "model.path=graft-test/tiny"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert "held-out accuracy of base model on graft-test/tiny" in done.stdout
    missing = subprocess.run([*common, "-o", "model.path=graft-test/absent"], capture_output=True, text=True, env=env,
                             timeout=300)
    assert missing.returncode == 2 and missing.stderr.strip().splitlines() == [
        "graft: error: graft-test/absent is neither a local directory, a packaged model (gemma3-270m, smollm2) nor a "
        f"model in the Hugging Face cache {tmp_path / 'hub'}: give a model directory or a packaged model's name, or "
        "download it first (`hf download graft-test/absent`)"]


def test_a_full_disk_is_one_line_naming_the_file(base_dir, tmp_path, capsys, monkeypatch):
    import errno

    from graft.train import trainer

    def no_space(config, path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(trainer, "save_config", no_space)
    code = main(["train", "-o", f"model.path={base_dir}", "-o", "rollout.engine=reference", "--run-dir",
                 str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0].startswith("graft: error: No space left on device: ") and "config.yaml" in err[0]


def test_a_full_disk_while_checkpointing_is_one_line_and_the_run_resumes(base_dir, tmp_path, capsys, monkeypatch):
    """safetensors reports a failed write as its own SafetensorError, not an OSError: graft turns it
    into the OSError it is, so the run ends in one line naming the file, and --resume continues."""
    import safetensors
    import safetensors.torch

    real_save = safetensors.torch.save_file

    def full_disk(tensors, path, metadata=None):  # the disk fills up during the step-2 checkpoint
        if "optimizer" in str(path) and list((tmp_path / "run" / "checkpoints").glob("step-*")):
            raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device "
                                              "(os error 28)")
        real_save(tensors, path, metadata=metadata)

    common = ["train", "-o", f"model.path={base_dir}", "-o", "rollout.engine=reference", "-o", "train.steps=2",
              "-o", "train.checkpoint_every=1", "-o", "train.eval_every=0", "-o", "train.batch_prompts=2",
              "-o", "rollout.n_samples=2", "-o", "rollout.max_new_tokens=2", "-o", "train.eval_examples=2",
              "--run-dir", str(tmp_path / "run")]
    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    code = main(common)
    out, err = capsys.readouterr()
    err = err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "sync mode adapter, delivery check within 0.001" in out  # the start line: fp32's fixed tolerance
    assert err[0].startswith("graft: error: No space left on device: ") and "optimizer.safetensors" in err[0]
    checkpoints = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step-*"))
    assert "--resume" in err[0] and checkpoints == ["step-000001"]  # no half-written step-2 checkpoint
    monkeypatch.setattr(safetensors.torch, "save_file", real_save)
    assert main([*common, "--resume"]) == 0


def test_resume_without_a_config_goes_on_with_the_run_s_own_and_names_what_o_changes(base_dir, tmp_path, capsys):
    """`graft train --run-dir D --resume -o train.steps=3`: D's config.yaml (lora.rank 4, its batch) with the
    one override, named on stderr; a CONFIG given at resume that differs is named the same way."""
    import yaml

    run = tmp_path / "run"
    first = ["-o", f"model.path={base_dir}", "-o", "rollout.engine=reference", "-o", "lora.rank=4",
             "-o", "train.batch_prompts=2", "-o", "rollout.n_samples=2", "-o", "rollout.max_new_tokens=2",
             "-o", "train.eval_examples=2", "-o", "train.steps=1", "--run-dir", str(run)]
    assert main(["train", *first]) == 0
    capsys.readouterr()
    assert main(["train", "--run-dir", str(run), "--resume", "-o", "train.steps=2"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"graft: resuming {run} with settings other than its config.yaml's: train.steps: 1 -> 2"]
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["lora"]["rank"] == 4 and saved["train"]["steps"] == 2
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    config = tmp_path / "other.yaml"
    config.write_text(f"model:\n  path: {base_dir}\nrollout:\n  engine: reference\n")
    assert main(["train", str(config), "--run-dir", str(run), "--resume", "-o", "train.steps=3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "lora.rank: 4 -> 8" in err[0] and "train.batch_prompts: 2 -> 8" in err[0]
    assert err[-1].startswith("graft: error: --resume: no checkpoint") and "loads" in err[-1]  # rank 4, not 8
    assert yaml.safe_load((run / "config.yaml").read_text()) == saved  # the refused resume changed nothing


def _bounded(kind) -> bool:
    """Whether `kind` is an argparse type made by `graft.config.arguments.at_least`."""
    return hasattr(kind, "minimum")


def _integer_flags(parser):
    """(flag, type) of every flag of `parser` and its subcommands that takes an integer, with the parser
    that reads it."""
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _integer_flags(sub)
        elif action.option_strings and (action.type is int or _bounded(action.type)):
            yield parser, action.option_strings[-1], action.type


def test_every_integer_flag_refuses_values_below_its_bound_when_parsed(capsys):
    """A count of 0 (layers, repeats, steps, ...), a negative seed or a port above 65535 is an error at
    parse time, naming the flag, for every command and bench: before, `graft tiny-model --layers 0` wrote a
    model of no layers and a bench of `--repeats 0` failed at its end on an empty median."""
    from graft.bench.commands import BENCHES, bench_parser

    flags = [f for parser in [build_parser(), *map(bench_parser, BENCHES)] for f in _integer_flags(parser)]
    assert len(flags) > 40 and [flag for _, flag, kind in flags if kind is int] == []
    for parser, flag, kind in flags:
        refused = [(kind.minimum - 1, f"must be at least {kind.minimum}")]
        if kind.maximum is not None:
            refused.append((kind.maximum + 1, f"must be at most {kind.maximum}"))
        for value, reason in refused:
            with pytest.raises(SystemExit) as exit_info:
                parser.parse_args([flag, str(value)])
            assert exit_info.value.code == 2
            assert f"argument {flag}: {reason} (got {value})" in capsys.readouterr().err, (parser.prog, flag)
    assert sorted(flag for _, flag, kind in flags if kind.maximum is not None) == ["--port", "--port"]  # serve, tenants
