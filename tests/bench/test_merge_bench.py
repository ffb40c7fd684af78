import json

from graft.bench.merge import run_merge_bench
from graft.cli import main


def test_merge_bench_measures_both_sides_and_drift():
    result = run_merge_bench(hidden=64, layers=1, rank=4, repeats=1, cycles=20)
    assert result["graft_seconds"] > 0 and result["peft_seconds"] > 0
    assert result["ratio"] == result["peft_seconds"] / result["graft_seconds"]
    assert result["graft_base_drift"] == 0.0
    # PEFT's in-place bf16 merge/unmerge rounds twice per cycle: the base moves.
    assert result["peft_bf16_drift_after_cycles"] > 0.0


def test_merge_bench_json(tmp_path, capsys):
    out = tmp_path / "merge.json"
    assert main(["bench", "merge", "--hidden", "64", "--layers", "1", "--repeats", "1", "--cycles", "2",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {"graft_seconds", "peft_seconds", "ratio", "graft_base_drift", "peft_bf16_drift_after_cycles",
            "cycles"} <= result.keys()
    assert "ratio PEFT/graft" in capsys.readouterr().out
