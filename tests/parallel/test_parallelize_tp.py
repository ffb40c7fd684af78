"""Tensor-parallel LoRA on a 2-D (dp, tp) mesh over CPU ranks (gloo) gives the single-process update:
tp=2 on 2 ranks and dp=2 x tp=2 on 4 ranks, 3 updates with mini-batches, micro-batches, KL (in the
loss or the reward), entropy and TIS: the same losses, grad norms, stats and LoRA weights (<= 1e-5),
also when a data-parallel rank has no rows. Checkpoints resume across meshes, published adapters
load in PEFT, and `graft train` under torchrun with dist.tp=2 matches one process (reference engine
and real vLLM). Every collective runs under a short process-group timeout, so a hang (the seed's
deadlocks) fails the test instead of stalling it."""

import dataclasses
import json
from types import SimpleNamespace

import pytest
import safetensors.torch
import torch
import torch.distributed as dist
from peft import PeftModel

from graft.cli import main
from graft.config import load_config
from graft.lora.adapter_io import ADAPTER_WEIGHTS, write_adapter_files
from graft.models.loading import load_model
from graft.models.tiny import build_tiny_model
from graft.parallel.dist import Dist, mesh_dist
from graft.parallel.parallelize import check_tensor_parallel
from graft.train.policy import PolicyState
from tests.helpers import assert_adam_weights_close
from tests.parallel.test_dist import init_gloo
from tests.parallel.test_parallelize import (
    _COMPARED,
    _batch,
    _graft_train,
    assert_like_one_process,
    run_cases_on_ranks,
)
from tests.spawn import spawn_ranks
from tests.train.test_mixed_precision import _update_recording_dtypes


@pytest.fixture(scope="module")
def tp_model_dirs(tmp_path_factory) -> dict[str, object]:
    """arch -> a tiny fp32 model TP can split by 2: hidden 128 (4 heads, 2 KV heads, MLP 384), 2 layers."""
    root = tmp_path_factory.mktemp("tiny-tp")
    return {arch: build_tiny_model(root / arch, arch=arch, hidden=128, layers=2, seed=0) for arch in ("qwen2", "llama")}


# Adam lr 1e-4: TP sums each row-wise layer's partial products in another order, so gradients agree
# only to ~1e-6 of their largest element (measured: 9.4e-7), and Adam divides by sqrt(v): an element
# whose gradient is near zero moved 3e-5 apart at lr 1e-3 and 4e-5 at 1e-2 (one of ~3000). A real
# sharding bug moves weights by ~lr per step, over 6 steps well beyond the 1e-5 compared.
_MENU = ["train.mini_batches=2", "train.tis_cap=2.0", "train.max_tokens_per_micro_batch=16", "train.lr=1e-4"]


# name -> (arch, n_prompts, group, overrides) on 2 ranks of tp=2.
TP2 = {
    "qwen2-menu": ("qwen2", 4, 2, _MENU),
    "llama-padded-kl-in-reward": ("llama", 3, 3, [*_MENU, "train.pack_sequences=false",
                                                  "train.activation_checkpointing=false", "train.kl_in=reward"]),
}
# name -> (n_prompts, group, overrides) on 4 ranks, dp=2 x tp=2 (qwen2).
DP2_TP2 = {
    "menu": (4, 2, _MENU),
    "kl-in-reward": (3, 3, [*_MENU, "train.kl_in=reward"]),  # each row's KL scored by one dp rank, summed over dp only
    # one row: dp rank 1 (ranks 2 and 3) has none, runs stand-ins and still joins every collective
    "one-row": (1, 1, ["train.max_tokens_per_micro_batch=4", "train.tis_cap=2.0", "train.lr=1e-4"]),
}


@pytest.fixture(scope="module")
def mesh_runs(tp_model_dirs, tmp_path_factory):
    """TP2's cases on one spawn of 2 ranks and DP2_TP2's on one spawn of 4; each case's results in
    its own directory of the returned one."""
    root = tmp_path_factory.mktemp("meshes")
    run_cases_on_ranks(2, 2, [(tp_model_dirs[arch], root / name, n, g, o) for name, (arch, n, g, o) in TP2.items()],
                       root / "tp2")
    run_cases_on_ranks(4, 2, [(tp_model_dirs["qwen2"], root / name, n, g, o) for name, (n, g, o) in DP2_TP2.items()],
                       root / "dp2-tp2")
    return root


@pytest.mark.parametrize("name", TP2)
def test_tp2_on_two_ranks_updates_like_one(tp_model_dirs, mesh_runs, name):
    arch, n_prompts, group, overrides = TP2[name]
    assert_like_one_process(tp_model_dirs[arch], mesh_runs / name, n_prompts, group, overrides)


@pytest.mark.parametrize("name", DP2_TP2)
def test_dp2_tp2_on_four_ranks_updates_like_one(tp_model_dirs, mesh_runs, name):
    n_prompts, group, overrides = DP2_TP2[name]
    assert_like_one_process(tp_model_dirs["qwen2"], mesh_runs / name, n_prompts, group, overrides)


def _bf16_rank(rank: int, model_dir, out_dir) -> None:
    init_gloo(rank, 4, out_dir / "rendezvous")
    try:
        (out_dir / f"rank{rank}.json").write_text(json.dumps(_update_recording_dtypes(model_dir, "bfloat16",
                                                                                      mesh_dist(2))))
    finally:
        dist.destroy_process_group()


def test_dp2_tp2_bf16_base_computes_in_bf16_and_keeps_fp32_lora_state(tp_model_dirs, tmp_path):
    """dp=2 x tp=2 with a bf16 base: FSDP2's mixed precision over the 2-D LoRA DTensors (forward in
    bf16; LoRA factors, gradients and AdamW state fp32), the fp32 one-process run's metrics to bf16
    rounding."""
    model_dir = tp_model_dirs["qwen2"]
    spawn_ranks(_bf16_rank, (model_dir, tmp_path), 4)
    single = _update_recording_dtypes(model_dir, "float32", Dist())
    for rank in range(4):
        sharded = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert sharded["forward"] == ["torch.bfloat16"] and sharded["base"] == ["torch.bfloat16"], rank
        for key in ("lora", "grad", "adamw"):
            assert sharded[key] == ["torch.float32"], (rank, key)
        for a, b in zip(single["metrics"], sharded["metrics"]):
            for key in ("loss", "grad_norm", "kl"):
                assert b[key] == pytest.approx(a[key], rel=0.05, abs=1e-3), (rank, key)

# --- checkpoints across meshes, published adapters -----------------------------------------------------

def _policy_config(model_dir):
    return load_config(None, [f"model.path={model_dir}", "rollout.engine=reference", "train.checkpoint_every=1",
                              "train.keep_checkpoints=0", "train.steps=5", "train.warmup_steps=0", "train.lr=1e-4",
                              "train.mini_batches=2", "train.tis_cap=2.0", "train.kl_coef=0.05",
                              "train.entropy_coef=0.01", "train.max_tokens_per_micro_batch=16"])


def _policy_step(ctx: Dist, model_dir, run_dir, out_dir, step: int) -> None:
    """One `graft train` step of the real trainer state on this mesh: resume from RUN_DIR's newest
    checkpoint (after step 1), learn, checkpoint; rank 0 writes the published adapter and the metrics,
    the other ranks follow its announced collectives."""
    policy = PolicyState(_policy_config(model_dir), run_dir, ctx, pad_id=0, resume=step > 1)
    if not ctx.is_main:
        policy.follow()
        return
    metrics = policy.learn(_batch(3, 2, seed=step), step)
    policy.maybe_checkpoint(step)
    weights = dataclasses.replace(policy.source.adapter(), dtype=torch.float32)
    (out_dir / f"adapter-{step}").mkdir()
    write_adapter_files(weights.converted(), weights.config, out_dir / f"adapter-{step}")
    (out_dir / f"metrics-{step}.json").write_text(json.dumps(metrics))
    if ctx.active:
        policy.release_followers()


def _policy_step_rank(rank: int, world: int, tp: int, model_dir, run_dir, out_dir, step: int) -> None:
    init_gloo(rank, world, out_dir / f"rendezvous-{step}")
    try:
        _policy_step(mesh_dist(tp), model_dir, run_dir, out_dir, step)
    finally:
        dist.destroy_process_group()


def _logits(model_dir, adapter_dir) -> torch.Tensor:
    model = PeftModel.from_pretrained(load_model(model_dir), str(adapter_dir))
    input_ids = torch.randint(3, 500, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(input_ids=input_ids).logits


def test_checkpoints_resume_across_meshes_and_published_adapters_load_in_peft(tp_model_dirs, tmp_path):
    """One run's 5 steps, each on another mesh, resuming from the previous step's checkpoint:
    tp=2 -> dp=2 -> dp=2 x tp=2 -> one process -> tp=2, against 5 steps on one process. Every step's
    metrics and every published adapter (PEFT names, loaded with `PeftModel.from_pretrained`: the
    same logits) equal the uninterrupted run's."""
    model_dir = tp_model_dirs["qwen2"]
    meshes = {1: (2, 2), 2: (2, 1), 3: (4, 2), 4: (1, 1), 5: (2, 2)}  # step -> (world, tp)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for step in meshes:
            (tmp_path / "one" / "out").mkdir(parents=True, exist_ok=True)
            _policy_step(Dist(), model_dir, tmp_path / "one", tmp_path / "one" / "out", step)
        (tmp_path / "mesh" / "out").mkdir(parents=True)
        for step, (world, tp) in meshes.items():
            if world == 1:
                _policy_step(Dist(), model_dir, tmp_path / "mesh", tmp_path / "mesh" / "out", step)
            else:
                spawn_ranks(_policy_step_rank,
                            (world, tp, model_dir, tmp_path / "mesh", tmp_path / "mesh" / "out", step), world)
    finally:
        torch.set_num_threads(threads)
    for step in meshes:
        one = json.loads((tmp_path / "one" / "out" / f"metrics-{step}.json").read_text())
        mesh = json.loads((tmp_path / "mesh" / "out" / f"metrics-{step}.json").read_text())
        for key in _COMPARED:
            assert mesh[key] == pytest.approx(one[key], rel=1e-5, abs=1e-6), (step, key)
        one_adapter = safetensors.torch.load_file(tmp_path / "one" / "out" / f"adapter-{step}" / ADAPTER_WEIGHTS)
        mesh_adapter = safetensors.torch.load_file(tmp_path / "mesh" / "out" / f"adapter-{step}" / ADAPTER_WEIGHTS)
        assert all(".default." not in key for key in mesh_adapter)  # PEFT's saved names
        assert_adam_weights_close(mesh_adapter, one_adapter, _policy_config(model_dir).train.lr)
    torch.testing.assert_close(_logits(model_dir, tmp_path / "mesh" / "out" / "adapter-5"),
                               _logits(model_dir, tmp_path / "one" / "out" / "adapter-5"), rtol=1e-5, atol=1e-5)


# --- errors before any process group work -------------------------------------------------------------------

def _hf_config(model_type="qwen2", heads=4, kv_heads=2, intermediate=384):
    return SimpleNamespace(model_type=model_type, num_attention_heads=heads, num_key_value_heads=kv_heads,
                           intermediate_size=intermediate)


@pytest.mark.parametrize("hf_config, targets, message", [
    (_hf_config(heads=3, kv_heads=1), "all-linear", "num_attention_heads \\(3\\)"),
    (_hf_config(kv_heads=1), "all-linear", "num_key_value_heads \\(1\\)"),
    (_hf_config(intermediate=385), "all-linear", "intermediate_size \\(385\\)"),
    (_hf_config(model_type="gpt2"), "all-linear", "no tensor-parallel plan for model_type 'gpt2'"),
    (_hf_config(), ["q_proj", "lm_head"], "LoRA on 'lm_head'"),
])
def test_tp_the_model_cannot_be_split_by_is_refused(hf_config, targets, message):
    with pytest.raises(ValueError, match=message):
        check_tensor_parallel(hf_config, 2, targets)
    check_tensor_parallel(hf_config, 1, targets)  # no TP: nothing to check


def test_lora_dropout_under_tp_is_refused():
    """A replicated lora_A needs the same input on every TP rank; per-rank dropout masks would differ."""
    with pytest.raises(ValueError, match="lora.dropout \\(0.1\\) must be 0 with dist.tp=2"):
        check_tensor_parallel(_hf_config(), 2, "all-linear", lora_dropout=0.1)
    check_tensor_parallel(_hf_config(), 2, "all-linear")
    check_tensor_parallel(_hf_config(), 1, "all-linear", lora_dropout=0.1)


def test_tp_is_checked_before_any_process_group(tiny_model_dirs, tp_model_dirs, tmp_path, capsys, monkeypatch):
    """`graft train -o dist.tp=2`: one `graft: error:` line and exit 2, with no process group joined and
    no run directory written, for a model whose KV heads it does not divide and for a world size (1)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cases = [(tiny_model_dirs["qwen2"], "dist.tp=2 does not divide the model's num_key_value_heads (1)"),
             (tp_model_dirs["qwen2"], "dist.tp=2 does not divide the world size 1")]
    for model_dir, message in cases:
        code = main(["train", "-o", f"model.path={model_dir}", "-o", "rollout.engine=reference", "-o", "dist.tp=2",
                     "--run-dir", str(tmp_path / "run")])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith(f"graft: error: {message}"), err
        assert not dist.is_initialized() and not (tmp_path / "run").exists()


# --- graft train under torchrun --------------------------------------------------------------------------

_RUN = ["model.dtype=float32", "train.steps=3", "train.batch_prompts=2", "rollout.n_samples=3",
        "rollout.max_new_tokens=4", "train.kl_coef=0.05", "train.lr=5e-3", "lora.rank=4", "train.eval_examples=2",
        "data.reward=format"]


def _assert_tp2_run_like_one(run_dir, overrides: list[str], gap: float) -> None:
    """`graft train` alone and under torchrun with dist.tp=2: the same samples and losses (<= 1e-5), the
    engine serving what the TP shards trained (log-prob gap below `gap`)."""
    one = _graft_train(run_dir / "one", overrides, nproc=1)
    two = _graft_train(run_dir / "two", [*overrides, "dist.tp=2"], nproc=2)
    assert [r["step"] for r in two] == [1, 2, 3]
    for a, b in zip(one, two):
        assert b["rollout_tokens"] == a["rollout_tokens"]  # the same samples
        for key in ("loss", "kl", "entropy", "grad_norm", "reward_mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (a["step"], key)
        assert b["sync_logprob_abs_diff_max"] < gap
        assert b["sync_bytes"] == a["sync_bytes"] and b["sync_mode"] == a["sync_mode"]


@pytest.mark.parametrize("mode", ["adapter", "merged"])
def test_graft_train_with_tp2_under_torchrun_matches_one_rank(tp_model_dirs, tmp_path, mode):
    """`torchrun --nproc-per-node 2 graft train ... -o dist.tp=2`: the same losses as one process
    (<= 1e-5) on the reference engine; rank 0 publishes (the adapter it gathers over tp, or the merged
    stream every rank joins) and verifies on the tensor-parallel model (the others joining)."""
    _assert_tp2_run_like_one(tmp_path, [f"model.path={tp_model_dirs['qwen2']}", "rollout.engine=reference",
                                        f"sync.mode={mode}", *_RUN], gap=1e-4)


@pytest.mark.vllm
def test_graft_train_with_tp2_under_torchrun_matches_one_rank_on_vllm(tp_model_dirs, tmp_path):
    """The same against a real vLLM server (one, serving the TP-splittable model, for both runs)."""
    from graft.rollout.vllm.launcher import VllmServer, VllmServerConfig

    model_dir = tp_model_dirs["qwen2"]
    with VllmServer(VllmServerConfig(model=str(model_dir), dtype="float32", max_lora_rank=8,
                                     log_dir=tmp_path)) as server:
        _assert_tp2_run_like_one(tmp_path, [f"model.path={model_dir}", f"rollout.urls=[{server.url}]",
                                            "rollout.max_lora_rank=8", *_RUN], gap=1e-3)  # fp32 vLLM
