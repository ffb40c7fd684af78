from dataclasses import replace

import pytest
import torch
from transformers import Qwen2ForCausalLM

from graft.bench.common import SHAPES, qwen2_config
from graft.bench.sync_sweep import (
    FLOORS,
    MODES,
    QWEN05,
    SIZE_SHAPES,
    SWEEPS,
    linear_fit,
    plot_sweep,
    print_sweep_report,
)
from graft.config import VLLM_LORA_RANKS


def _params(shape) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in Qwen2ForCausalLM(qwen2_config(shape)).parameters())


def test_size_shapes_are_valid_for_vllm_cpu_and_grow_to_qwen25_05b():
    for shape in SIZE_SHAPES:
        assert shape.hidden % shape.heads == 0 and shape.hidden // shape.heads >= 32, shape
        assert shape.heads % shape.kv_heads == 0 and shape.rank == 16, shape
    params = [_params(shape) for shape in SIZE_SHAPES]
    assert all(a < b for a, b in zip(params, params[1:])), params
    assert SIZE_SHAPES[-1] == SHAPES["qwen2.5-0.5b-shape"]
    assert params[-1] == 494_032_768  # Qwen2.5-0.5B's parameter count
    assert SWEEPS["size"] == [[shape] for shape in SIZE_SHAPES]


def test_rank_sweep_is_one_server_at_the_05b_shape_with_ranks_vllm_accepts():
    [group] = SWEEPS["rank"]
    assert [shape.rank for shape in group] == [8, 16, 32, 64, 128]
    assert all(replace(shape, rank=16) == QWEN05 for shape in group)
    assert all(shape.rank in VLLM_LORA_RANKS for shape in group)


def test_linear_fit_recovers_a_line_and_scores_noise():
    x = [1.0, 2.0, 4.0, 8.0, 16.0]
    slope, intercept, r2 = linear_fit(x, [0.05 * v + 0.2 for v in x])
    assert slope == pytest.approx(0.05) and intercept == pytest.approx(0.2) and r2 == pytest.approx(1.0)
    noisy = [0.05 * v + 0.2 + e for v, e in zip(x, (0.1, -0.1, 0.1, -0.1, 0.1))]
    assert 0.5 < linear_fit(x, noisy)[2] < 1.0
    assert linear_fit([3.0, 3.0], [1.0, 2.0]) is None


def _synthetic(sweep: str) -> dict:
    """Rows as run_sync_sweep returns them: adapter bytes grow with size/rank, merged with size."""
    points = [(s.name, 100_000 * 9**i, 16, 2**20 * 4**i, 2**20 * 9**i) for i, s in enumerate(SIZE_SHAPES)] \
        if sweep == "size" else [(QWEN05.name, 494_032_768, r, 2**20 * r, 942 * 2**20) for r in (8, 16, 32)]
    rows = []
    for model, params, rank, adapter_bytes, merged_bytes in points:
        seconds = {"adapter": 0.1 + adapter_bytes / 2**30, "adapter_publish": 0.05 + adapter_bytes / 2**31,
                   "raw_write": 0.01 + adapter_bytes / 2**31, "merged": 1.0 + merged_bytes / 2**28,
                   "merged_publish": 0.8 + merged_bytes / 2**28, "merged_raw_write": merged_bytes / 2**29}
        rows += [{"model": model, "params": params, "rank": rank, "mode": mode, "seconds": seconds[mode],
                  "bytes": adapter_bytes if FLOORS[mode] == "raw_write" else merged_bytes} for mode in MODES]
    return {"sweep": sweep, "repeats": 3, "rows": rows}


@pytest.mark.parametrize("sweep", ["size", "rank"])
def test_plot_sweep_writes_a_png(tmp_path, sweep):
    path = plot_sweep(_synthetic(sweep), tmp_path / f"{sweep}.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_prints_table_fit_and_floor_ratios(capsys):
    print_sweep_report(_synthetic("rank"))
    out = capsys.readouterr().out
    assert "merged_raw_write" in out and "adapter seconds vs MiB: slope" in out and "R² 1.000" in out
    assert "adapter / raw_write:" in out and "qwen2.5-0.5b-shape r32" in out
    assert "merged seconds vs MiB" not in out  # one merged size in a rank sweep: no fit

