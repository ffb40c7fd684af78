"""The result tables of README.md, docs/benchmarks.md and docs/tenants.md are rendered from
docs/results/*.json: rendered again they are unchanged (and so is docs/config.md's reference), every
result file is shown and says where it came from, and a bench's --record and `graft bench report
--add` keep a result with its machine, date, command and revision."""

import datetime
import json
import os
import re
import sys
import types

import pytest

from graft.bench import commands
from graft.bench.report import results
from graft.bench.report.render import DOCS, TABLES, main, render_block, results_blocks
from graft.bench.report.results import ROOT, load_results
from graft.bench.report.runs import quickstart_accuracy, quickstart_steps
from graft.config.docs_blocks import rewrite


def test_the_docs_hold_the_rendered_blocks(capsys):
    assert main(["--check"]) == 0, capsys.readouterr().out


def test_every_table_is_in_the_docs_and_every_result_in_a_table():
    blocks = results_blocks({}).pattern
    shown = {m["name"] for doc in DOCS for m in blocks.finditer((ROOT / doc).read_text())}
    assert shown == set(TABLES)
    assert {name for files, _ in TABLES.values() for name in files} == set(load_results())


def test_every_result_says_where_it_came_from():
    for name, kept in load_results().items():
        assert kept["name"] == name
        assert datetime.date.fromisoformat(kept["date"]) <= datetime.date.today()
        assert kept["command"].startswith(("graft ", "make ")), name
        assert kept["machine"]["cores"] or kept["machine"]["gpu"], name
        assert isinstance(kept["result"], dict) and kept["result"], name


@pytest.fixture
def fake_bench(tmp_path, monkeypatch):
    """`graft bench fake [--size N] [--fail]`: its result {"size": N} (and a failed side), kept under tmp_path."""
    bench = types.ModuleType("fake_bench")
    bench.add_arguments = lambda parser: (parser.add_argument("--size", type=int, default=1),
                                          parser.add_argument("--fail", action="store_true"))
    bench.run = lambda args: {"size": args.size, **({"failed": {"trl": "no venv"}} if args.fail else {})}
    monkeypatch.setitem(sys.modules, "fake_bench", bench)
    monkeypatch.setitem(commands.BENCHES, "fake", commands.Bench("fake_bench", "a bench of the tests"))
    monkeypatch.setattr(results, "RESULTS_DIR", tmp_path / "results")
    return tmp_path / "results"


def test_record_keeps_a_bench_result_with_its_provenance(fake_bench):
    assert commands.run_bench("fake", ["--size", "3", "--record", "fake-3"]) == 0
    kept = json.loads((fake_bench / "fake-3.json").read_text())
    assert kept["command"] == "graft bench fake --size 3 --record fake-3"
    assert kept["result"] == {"size": 3}
    assert kept["date"] == datetime.date.today().isoformat()
    assert kept["machine"]["cores"] == os.cpu_count()
    assert kept["git"] is None or re.fullmatch(r"[0-9a-f]{7,}(\+changes)?", kept["git"])
    assert commands.run_bench("fake", ["--record"]) == 0
    assert json.loads((fake_bench / "fake.json").read_text())["result"] == {"size": 1}


def test_a_failed_bench_is_not_recorded(fake_bench, capsys):
    assert commands.run_bench("fake", ["--fail", "--record"]) == 1
    assert not (fake_bench / "fake.json").exists()
    assert "not recorded" in capsys.readouterr().err


def test_a_result_name_is_checked_before_the_bench_runs(fake_bench, capsys):
    with pytest.raises(SystemExit):
        commands.run_bench("fake", ["--record", "../elsewhere"])
    assert "a plain file name" in capsys.readouterr().err
    with pytest.raises(ValueError, match="a plain file name"):
        results.record("../elsewhere", {}, "graft bench fake")


def _quickstart_run(run_dir):
    run_dir.mkdir()
    (run_dir / "quickstart.json").write_text(json.dumps({
        "task": "arithmetic", "model": "smollm2", "seed": 1, "accuracy_before": 0.09, "accuracy_after": 0.5,
        "seconds": 301.4, "steps": 4, "sync_load_seconds_median": 0.2, "verify_seconds_median": 9.0,
        "max_sync_logprob_gap": 2e-5}))
    (run_dir / "eval.jsonl").write_text("".join(json.dumps({"step": s, "accuracy": a}) + "\n"
                                                for s, a in ((0, 0.09), (2, 0.3), (4, 0.5))))
    (run_dir / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "step_seconds": 10.0 + s, "rollout_seconds": 9.0, "train_seconds": 7.0 + s}) + "\n"
        for s in range(1, 5)))


def test_a_quickstart_run_is_kept_with_its_evaluations_and_step_medians(tmp_path, capsys):
    _quickstart_run(tmp_path / "qs")
    page = tmp_path / "page.md"
    page.write_text("no tables here\n")
    assert main(["--add", "qs-1", str(tmp_path / "qs"), "--results", str(tmp_path / "results"), str(page)]) == 0
    kept = json.loads((tmp_path / "results" / "qs-1.json").read_text())
    assert kept["command"] == f"graft quickstart --model smollm2 --seed 1 --run-dir {tmp_path / 'qs'}"
    assert kept["result"]["evaluations"][1] == {"step": 2, "accuracy": 0.3}
    assert (kept["result"]["step_seconds_median"], kept["result"]["train_seconds_median"]) == (13.0, 10.0)
    assert quickstart_accuracy([kept])[2] == "| 1 | 9.0% | 30.0% | 50.0% | +41.0 points | 301 s |"
    assert quickstart_steps([kept])[2] == "| 1 | 13.0 s (9.0 / 10.0) | 0.20 / 9.00 s | 2.0e-05 |"


def test_a_json_file_is_kept_only_with_the_command_that_made_it(tmp_path):
    made = tmp_path / "gpu-check.json"
    made.write_text(json.dumps({"device": "a GPU", "seconds": 60, "checks": []}))
    with pytest.raises(ValueError, match="--command"):
        results.add("gpu-check", made, directory=tmp_path / "results")
    path = results.add("gpu-check", made, "make gpu-check", directory=tmp_path / "results")
    assert json.loads(path.read_text())["command"] == "make gpu-check"


def test_a_stale_block_is_rewritten_and_check_sees_it(tmp_path):
    from graft.cli import main as graft_main

    page = tmp_path / "page.md"
    page.write_text("intro\n<!-- results:merge -->\nold\n<!-- /results:merge -->\nend\n")
    assert graft_main(["bench", "report", "--check", str(page)]) == 1
    assert graft_main(["bench", "report", str(page)]) == 0
    assert page.read_text() == f"intro\n<!-- results:merge -->\n{render_block('merge', load_results())}" \
                               "<!-- /results:merge -->\nend\n"
    assert graft_main(["bench", "report", "--check", str(page)]) == 0


def test_an_unknown_block_or_a_missing_result_is_an_error():
    with pytest.raises(ValueError, match="unknown results block 'nope'"):
        rewrite("<!-- results:nope -->\n<!-- /results:nope -->", results_blocks({}))
    with pytest.raises(ValueError, match="no docs/results/merge.json"):
        render_block("merge", {})
