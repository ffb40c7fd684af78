"""The sync benches against a real server: `graft bench sync`, `--stall` and a reduced `--sweep rank`,
all on one bench server of the tiny shape (each bench starts its own: ~27 s a start on 2 cores), and
the stall arithmetic."""

import contextlib
from dataclasses import replace

import pytest
import torch
from transformers import Qwen2ForCausalLM

from graft.bench import common, sync, sync_sweep
from graft.bench.common import SHAPES, qwen2_config
from graft.bench.sync import run_sync_bench
from graft.bench.sync_stall import run_stall_probe, stall_of
from graft.bench.sync_sweep import MODES, run_sync_sweep


@pytest.fixture(scope="module")
def one_bench_server(tmp_path_factory):
    """`bench_server` started once per base shape and LoRA rank for this file's benches; the benches'
    rounds measure times and sizes, which a server another bench synced before serves as well."""
    started, real = {}, common.bench_server
    with contextlib.ExitStack() as servers, pytest.MonkeyPatch.context() as patch:
        @contextlib.contextmanager
        def shared(shape, work, max_lora_rank, console):
            key = (replace(shape, rank=0), max_lora_rank)  # the base is the same at any LoRA rank
            if key not in started:
                started[key] = servers.enter_context(real(shape, tmp_path_factory.mktemp("bench"), max_lora_rank,
                                                          console))
            yield started[key]

        for module in (common, sync, sync_sweep):  # sync_stall imports it from common when it runs
            patch.setattr(module, "bench_server", shared)
        yield started


@pytest.mark.vllm
def test_sync_bench_measures_every_mode_against_a_real_server(one_bench_server):
    result = run_sync_bench(("tiny",), repeats=1)
    rows = {row["mode"]: row for row in result["rows"]}
    assert set(rows) == {"adapter", "adapter-memory", "adapter-memory-shm", "adapter_publish", "merged", "full",
                         "raw_write"}
    assert all(row["model"] == "tiny" and row["seconds"] > 0 and row["bytes"] > 0 for row in rows.values())
    # An adapter is a small fraction of the model; merged and full publish the whole model.
    assert rows["adapter"]["bytes"] < rows["merged"]["bytes"] == rows["full"]["bytes"]
    assert rows["adapter_publish"]["seconds"] <= rows["adapter"]["seconds"]
    # The memory transports send the same tensors as one blob (the config in its header, not a file).
    for mode in ("adapter-memory", "adapter-memory-shm"):
        assert abs(rows[mode]["bytes"] - rows["adapter"]["bytes"]) < 0.05 * rows["adapter"]["bytes"]
    for mode in ("adapter", "adapter-memory", "adapter-memory-shm"):  # servable before the old ones are retired
        assert 0 < rows[mode]["servable_seconds"] <= rows[mode]["seconds"]
    assert "servable_seconds" not in rows["merged"]


@pytest.mark.vllm
def test_the_stall_probe_times_tokens_of_requests_decoding_across_a_sync_by_each_transport(one_bench_server):
    # Requests of 40 tokens (~0.1 s): each stream's requests follow one another across the sync.
    result = run_stall_probe(("tiny",), syncs=1, max_tokens=40)
    assert [row["transport"] for row in result["rows"]] == ["disk", "memory", "shm"]
    for row in result["rows"]:
        assert row["gaps_during_sync"] >= 1 and row["gaps"] > row["gaps_during_sync"]
        assert 0 < row["median_gap_s"] <= row["max_gap_during_sync_s"] * row["gaps"]
        assert row["ratio"] == pytest.approx(row["max_gap_during_sync_s"] / row["median_gap_s"])


@pytest.mark.vllm
def test_reduced_rank_sweep_against_a_real_server(one_bench_server):
    tiny = SHAPES["tiny"]
    with torch.device("meta"):
        params = sum(p.numel() for p in Qwen2ForCausalLM(qwen2_config(tiny)).parameters())
    result = run_sync_sweep("rank", repeats=1, groups=[[replace(tiny, rank=8), replace(tiny, rank=16)]])
    assert len(one_bench_server) == 1  # the sweep's server was the other benches'
    rows = {(row["rank"], row["mode"]): row for row in result["rows"]}
    assert set(rows) == {(rank, mode) for rank in (8, 16) for mode in MODES}
    assert all(row["model"] == tiny.name and row["params"] == params and row["seconds"] > 0 and row["bytes"] > 0
               for row in rows.values())
    # Adapter tensors double with the rank; merged publishes the whole model at any rank.
    assert rows[16, "raw_write"]["bytes"] == 2 * rows[8, "raw_write"]["bytes"]
    assert rows[8, "raw_write"]["bytes"] < rows[8, "adapter"]["bytes"]  # + config, header
    assert rows[8, "merged"]["bytes"] == rows[16, "merged"]["bytes"] >= rows[8, "merged_raw_write"]["bytes"]
    assert rows[16, "merged_raw_write"]["bytes"] == 2 * params  # bf16
    for rank in (8, 16):
        assert rows[rank, "adapter_publish"]["seconds"] <= rows[rank, "adapter"]["seconds"]
        assert rows[rank, "merged_publish"]["seconds"] <= rows[rank, "merged"]["seconds"]


def test_a_stall_is_the_largest_gap_overlapping_a_sync_against_the_per_token_pace():
    # Request 0: a token every 10 ms, then one that waited 50 ms across the sync at 0.032-0.036 s.
    # Request 1: chunks of 2 tokens every 20 ms (10 ms a token), one of them overlapping the sync.
    chunks = [[(0.0, 1), (0.01, 1), (0.02, 1), (0.07, 1), (0.08, 1)], [(0.0, 2), (0.02, 2), (0.04, 2)]]
    stall = stall_of(chunks, [(0.032, 0.036)])
    assert stall["median_gap_s"] == pytest.approx(0.01)
    assert stall["max_gap_during_sync_s"] == pytest.approx(0.05) and stall["ratio"] == pytest.approx(5)
    assert stall["gaps_during_sync"] == 2 and stall["gaps"] == 4 + 4
    with pytest.raises(ValueError, match="too short"):
        stall_of(chunks, [(1.0, 2.0)])
