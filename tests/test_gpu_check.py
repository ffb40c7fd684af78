"""`make gpu-check`'s script, tried on the CPU (`--allow-cpu`) so that it cannot rot between GPU runs:
a check that passes, one that fails (the table says FAIL and the script exits 1), and the refusal
without a GPU."""

import importlib.util
import json
import tarfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_a_gpu_the_check_refuses_in_one_line(gpu_check, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("graft: error: gpu-check needs a CUDA GPU")


def test_resume_and_export_pass_on_the_cpu_and_a_failing_check_fails_the_run(gpu_check, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    archive = tmp_path / "back" / "gpu-check.tar.gz"
    code = gpu_check.main(["--allow-cpu", "--out", str(tmp_path), "--skip", "tests,train", "--steps", "1", "--timeout",
                           "900", "--bench-args=--no-such-flag", "--bundle", str(archive)])
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    status = {row["check"]: row["status"] for row in report["checks"]}
    assert status == {"tiny model": "pass", "resume (first part)": "pass", "resume": "pass", "export": "pass",
                      "update bench": "FAIL"}
    table = (tmp_path / "gpu-check.md").read_text()
    assert code == 1 and table.startswith("4 of 5 checks passed") and "| update bench | FAIL |" in table
    steps = [json.loads(line)["step"] for line in (tmp_path / "run-resume" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    assert (tmp_path / "exported" / "config.json").exists()
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
    assert {"gpu-check.md", "gpu-check.json", "logs/update-bench.log", "logs/resume.log"} <= names
    assert not any(name.startswith(("site", "tiny-base", "run-", "exported")) for name in names), names


def test_the_update_sweep_names_settings_graft_accepts(gpu_check):
    from graft.bench.memory_shape import QWEN_SHAPE
    from graft.bench.update import parse_variants
    from graft.rl.logprobs import DEFAULT_CHUNK_ELEMENTS

    variants = parse_variants(list(gpu_check.UPDATE_SWEEP), [])
    assert len(variants) == len(gpu_check.UPDATE_SWEEP)
    # the sizes before memory-aware ones: the CPU's 64 MiB head chunk at the bench's vocabulary
    assert variants["fixed-8k"] == ["train.max_tokens_per_micro_batch=8192",
                                    f"train.logit_chunk_tokens={DEFAULT_CHUNK_ELEMENTS // QWEN_SHAPE['vocab']}"]


def test_the_vllm_smoke_check_parses_graft_s_cuda_command_with_vllm_s_own_parser():
    """The smoke check on this machine's vLLM (the GPU box runs it on the carried CUDA vLLM 0.20.2): a
    stand-in CUDA platform, graft's CUDA command line parsed by vLLM, the patches a CUDA server gets."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_vllm_smoke.py")], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    line = done.stdout.strip().splitlines()[-1]
    assert "graft's CUDA command parsed" in line and "--gpu-memory-utilization 0.3" in line, line
    assert "patches lora_block_keys, batch_route, memory_adapters, skipped short_busy_wait, lora_cpu" in line, line


def test_a_failed_vllm_smoke_check_starts_no_vllm_run(gpu_check, tmp_path):
    class Recorded(gpu_check.Checks):
        def run(self, name, argv, judge=None, timeout_s=None):
            row = {"check": name, "status": "FAIL" if name == "vllm smoke" else "pass", "seconds": 0, "detail": ""}
            self.rows.append(row)
            return row

    checks = Recorded(tmp_path, {}, timeout_s=1)
    gpu_check.run_vllm(checks, tmp_path / "base", 1, tmp_path / "site")
    assert [row["check"] for row in checks.rows] == ["vllm smoke"]


def test_the_gpu_tests_step_collects_every_gpu_test_from_the_files_it_names(gpu_check):
    import subprocess
    import sys

    # The whole suite collected once (a subprocess: ~15 s of imports), its gpu tests by node id.
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-m", "gpu", "-p",
                           "no:cacheprovider", "tests"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    gpu_tests = [line for line in done.stdout.splitlines() if "::" in line]
    files = gpu_check.gpu_test_files()
    assert files and all(path.name.startswith("test_") for path in files)
    assert gpu_tests and {ROOT / line.split("::")[0] for line in gpu_tests} == set(files), done.stdout[-2000:]
