import asyncio
import json

import pytest

from graft.config import load_config
from graft.train.metrics import REQUIRED_KEYS
from graft.train.trainer import train


@pytest.mark.parametrize("mode", ["adapter", "merged"])
def test_grpo_run_on_the_reference_engine_writes_every_metric(base_dir, tmp_path, mode):
    config = load_config(None, [f"model.path={base_dir}", "rollout.engine=reference", f"sync.mode={mode}",
                                "train.steps=2", "train.batch_prompts=2", "rollout.n_samples=3",
                                "rollout.max_new_tokens=4", "train.kl_coef=0.01", "lora.rank=4",
                                "train.eval_examples=4"])
    result = asyncio.run(train(config, tmp_path))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and [r["policy_version"] for r in rows] == [1, 2]
    for row in rows:
        assert set(REQUIRED_KEYS) <= row.keys()
        assert row["sync_mode"] == mode and row["staleness_max"] == 0 and row["sync_transport"] == "disk"
        assert 0 < row["rollout_tokens"] <= 2 * 3 * 4  # max_new_tokens caps each sample; eos may stop one early
        assert row["logprob_abs_diff_max"] < 1e-3  # the reference engine computes what the trainer computes
        assert row["grad_norm"] >= 0 and row["kl"] >= 0
    assert row["engine_adapters_loaded"] == (2 if mode == "adapter" else 0)  # keep_versions auto = 2
    assert 0.0 <= result["accuracy_before"] <= 1.0 and 0.0 <= result["accuracy_after"] <= 1.0
    assert (tmp_path / "reward.png").stat().st_size > 0 and (tmp_path / "config.yaml").is_file()


@pytest.mark.vllm
@pytest.mark.parametrize("mode", ["adapter", "merged"])
def test_grpo_run_against_the_real_vllm_server(vllm_server, base_dir, tmp_path, mode):
    from graft.rollout.vllm.client import VllmClient

    config = load_config(None, [f"model.path={base_dir}", f"rollout.urls=[{vllm_server.url}]", f"sync.mode={mode}",
                                "train.steps=2", "train.batch_prompts=2", "rollout.n_samples=4",
                                "rollout.max_new_tokens=6", "lora.rank=8", "rollout.max_lora_rank=8",
                                "train.eval_examples=4"])
    try:
        asyncio.run(train(config, tmp_path))
    finally:
        async def restore():
            async with VllmClient(vllm_server.url) as client:
                await client.reload_weights(str(base_dir))
                return await client.list_adapters()
        assert asyncio.run(restore()) == []  # the run unloaded every adapter it loaded
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in rows] == [1, 2]
    for row in rows:
        assert set(REQUIRED_KEYS) <= row.keys() and row["sync_mode"] == mode
        assert row["logprob_abs_diff_max"] < 1e-3  # fp32 vLLM vs the fp32 trainer on the sampled tokens
        # sync.transport auto: adapters reach a local graft-started vLLM through shared memory, no file
        assert row["sync_transport"] == ("shm" if mode == "adapter" else "disk")
    if mode == "adapter":
        assert not [p for p in (tmp_path / "weights").iterdir() if p.name.startswith("adapter-v")]


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


_COMPARED = ("reward_mean", "reward_std", "loss", "kl", "entropy", "grad_norm", "logprob_abs_diff_max",
             "rollout_tokens", "policy_version")


@pytest.fixture
def parity_reward(monkeypatch):
    """A reward a random tiny model earns about half the time, so GRPO has a signal to follow."""
    from graft.tasks.rewards import REWARDS

    monkeypatch.setitem(REWARDS, "parity", lambda text, example: float(len(text) % 2 == 0))
    return "data.reward=parity"


def test_each_reward_is_logged_and_their_weighted_sum_trains(base_dir, tmp_path, monkeypatch, parity_reward):
    from graft.tasks.rewards import REWARDS

    monkeypatch.setitem(REWARDS, "length", lambda text, example: float(len(text)))
    overrides = [f"model.path={base_dir}", "rollout.engine=reference", "train.steps=2", "train.batch_prompts=2",
                 "rollout.n_samples=3", "rollout.max_new_tokens=4", "train.eval_examples=2", "lora.rank=4",
                 "data.rewards=[{name: parity, weight: 2.0}, {name: length, weight: -0.1}]"]
    asyncio.run(train(load_config(None, overrides), tmp_path))
    for row in _rows(tmp_path):
        assert row["reward_errors"] == 0 and row["reward/length"] > 0
        weighted = 2.0 * row["reward/parity"] - 0.1 * row["reward/length"]
        assert row["reward_mean"] == pytest.approx(weighted, rel=1e-5)


# DAPO's dynamic sampling and shaping: refill rounds are a pure function of (seed, step, round). (The
# tiny random model seldom ends a completion before max_new_tokens, so the overlong filter, tested on
# the update, would leave most steps without rows here.)
_DAPO = ["train.filter_groups=true", "train.overlong_buffer_tokens=2", "train.kl_in=reward"]


@pytest.mark.parametrize("extra", [[], _DAPO], ids=["grpo", "dapo-filters"])
def test_resume_after_step_k_repeats_the_uninterrupted_run(base_dir, tmp_path, parity_reward, extra):
    """Stopped after step 2 and resumed, steps 3..5 give the metrics of the uninterrupted run (fp32,
    one rank, the deterministic reference engine)."""
    overrides = [f"model.path={base_dir}", "model.dtype=float32", "rollout.engine=reference", "train.batch_prompts=2",
                 parity_reward,
                 "rollout.n_samples=3", "rollout.max_new_tokens=4", "train.kl_coef=0.01", "train.lr=5e-3",
                 "lora.rank=4", "train.eval_examples=2", "train.checkpoint_every=1", "train.warmup_steps=3",
                 "train.lr_schedule=cosine", "train.min_lr_ratio=0.2", *extra]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    asyncio.run(train(load_config(None, [*overrides, "train.steps=5"]), whole))
    asyncio.run(train(load_config(None, [*overrides, "train.steps=2"]), parts))
    result = asyncio.run(train(load_config(None, [*overrides, "train.steps=5"]), parts, resume=True))
    assert result["resumed_from"] == 2 and result["accuracy_before"] is not None  # kept from the first part
    expected, got = _rows(whole), _rows(parts)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5] and [r["lr"] for r in got] == [r["lr"] for r in expected]
    for want, have in zip(expected[2:], got[2:]):
        for key in _COMPARED:
            assert have[key] == pytest.approx(want[key], rel=1e-6, abs=1e-7), (have["step"], key)
    assert len({r["grad_norm"] for r in expected[2:]}) == 3 and all(r["grad_norm"] > 0 for r in expected[2:])
    if extra:
        for want, have in zip(expected[2:], got[2:]):
            for key in ("sampling_rounds", "informative_groups", "filtered_groups", "overlong_penalty_mean",
                        "reward_kl_penalty", "truncated_fraction"):
                assert have[key] == pytest.approx(want[key], rel=1e-6, abs=1e-7), (have["step"], key)
        assert {r["informative_groups"] for r in expected} <= {0, 1, 2}
        assert max(r["sampling_rounds"] for r in expected) > 1  # some step refilled a group without signal
        # step 1 samples the zero-initialised adapter: the base itself, no KL yet
        assert all(r["overlong_penalty_mean"] < 0 for r in expected) and expected[0]["reward_kl_penalty"] == 0
        assert all(r["reward_kl_penalty"] != 0 for r in expected[1:])


def test_fresh_run_refuses_a_run_dir_with_checkpoints_and_resume_needs_one(base_dir, tmp_path):
    from graft.train.trainer import ResumeError

    overrides = [f"model.path={base_dir}", "rollout.engine=reference", "train.steps=1", "train.batch_prompts=1",
                 "rollout.n_samples=2", "rollout.max_new_tokens=2", "train.eval_examples=1", "lora.rank=4"]
    with pytest.raises(ResumeError, match="no checkpoint"):
        asyncio.run(train(load_config(None, overrides), tmp_path, resume=True))
    asyncio.run(train(load_config(None, overrides), tmp_path))
    written = (tmp_path / "config.yaml").read_text()
    with pytest.raises(ResumeError, match="--resume"):
        asyncio.run(train(load_config(None, [*overrides, "train.lr=0.5"]), tmp_path))
    assert (tmp_path / "config.yaml").read_text() == written  # the refused start changed nothing


def test_tensorboard_events_hold_the_metrics(base_dir, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    overrides = [f"model.path={base_dir}", "rollout.engine=reference", "train.steps=2", "train.batch_prompts=1",
                 "rollout.n_samples=2", "rollout.max_new_tokens=2", "train.eval_examples=1", "lora.rank=4"]
    asyncio.run(train(load_config(None, overrides), tmp_path))
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    losses = [(e.step, e.value) for e in events.Scalars("train/loss")]
    rows = _rows(tmp_path)
    assert losses == [(r["step"], pytest.approx(r["loss"], rel=1e-6, abs=1e-9)) for r in rows]
    assert [e.step for e in events.Scalars("eval/accuracy")] == [0, 2]


@pytest.mark.vllm
def test_async_rollout_with_staleness_one_keeps_the_adapter_window(vllm_server, base_dir, tmp_path):
    """max_staleness 1 on the real server: batches come from the current or the previous version,
    generation overlaps training, and the engine holds keep_versions (3) adapters after each sync and
    never more than max_loras (4): a new version loads into the free slot before the oldest leaves."""
    from graft.rollout.vllm.client import VllmClient
    from graft.sync.adapter import adapter_version

    config = load_config(None, [f"model.path={base_dir}", f"rollout.urls=[{vllm_server.url}]", "sync.mode=adapter",
                                "rollout.max_staleness=1", "train.tis_cap=2.0", "train.steps=6",
                                "train.batch_prompts=2", "rollout.n_samples=4", "rollout.max_new_tokens=6",
                                "lora.rank=8", "rollout.max_lora_rank=8", "train.eval_examples=2"])
    seen: list[int] = []

    async def run_and_watch():
        async with VllmClient(vllm_server.url) as client:
            task = asyncio.create_task(train(config, tmp_path))
            while not task.done():  # poll the server itself, not graft's own count
                seen.append(sum(adapter_version("graft", name) is not None for name in await client.list_adapters()))
                await asyncio.sleep(0.05)
            await task
            return await client.list_adapters()

    assert asyncio.run(run_and_watch()) == []
    rows = _rows(tmp_path)
    assert [r["policy_version"] for r in rows] == list(range(1, 7))
    assert max(seen) <= 4 and max(r["engine_adapters_loaded"] for r in rows) == 3
    assert all(r["staleness_max"] in (0, 1) for r in rows) and any(r["staleness_max"] == 1 for r in rows)
    assert all(r["dropped_stale_batches"] == 0 for r in rows)


@pytest.mark.vllm
def test_adapters_a_killed_run_left_on_a_user_server_block_neither_a_rerun_nor_a_resume(vllm_server, base_dir,
                                                                                       tmp_path):
    """A run killed mid-way leaves `<lora.name>-v*` on a server the user runs; the next fresh run
    and a `--resume` load the same names again. Both must start, and leave the server clean."""
    from graft.lora.adapter_io import save_adapter
    from graft.rollout.vllm.client import VllmClient
    from tests.helpers import trained_like_peft_model

    leftover = tmp_path / "leftover"
    save_adapter(trained_like_peft_model(base_dir), leftover)
    config = load_config(None, [f"model.path={base_dir}", f"rollout.urls=[{vllm_server.url}]", "lora.name=killed",
                                "train.steps=2", "train.batch_prompts=2", "rollout.n_samples=2",
                                "rollout.max_new_tokens=4", "rollout.max_lora_rank=8", "train.eval_examples=2",
                                "train.checkpoint_every=1"])

    async def leave_behind(*names):
        async with VllmClient(vllm_server.url) as client:
            for name in names:
                await client.load_adapter(name, str(leftover))

    async def adapters():
        async with VllmClient(vllm_server.url) as client:
            return await client.list_adapters()

    asyncio.run(leave_behind("killed-v0", "killed-v1", "killed-v2"))
    asyncio.run(train(config, tmp_path / "fresh"))
    assert asyncio.run(adapters()) == []
    asyncio.run(leave_behind("killed-v2"))  # as if killed after step 2's sync; resume from step 2 to 3
    resumed = config.model_copy(update={"train": config.train.model_copy(update={"steps": 3})})
    assert asyncio.run(train(resumed, tmp_path / "fresh", resume=True))["resumed_from"] == 2
    assert asyncio.run(adapters()) == []
    assert [r["step"] for r in _rows(tmp_path / "fresh")] == [1, 2, 3]


@pytest.mark.vllm
def test_a_diverging_run_stops_with_one_line_and_the_server_keeps_its_last_good_version(vllm_server, base_dir,
                                                                                        tmp_path):
    """lr 1e30: within two updates the weights overflow. The run stops with one line before that
    version reaches the server, which keeps serving the last good version and answers plain
    base-model requests."""
    import subprocess
    import sys

    from graft.rollout.engine import GenerateRequest, SamplingParams
    from graft.rollout.vllm.client import VllmClient

    overrides = [f"model.path={base_dir}", f"rollout.urls=[{vllm_server.url}]", "lora.name=diverged",
                 "train.steps=3", "train.batch_prompts=2", "rollout.n_samples=4", "rollout.max_new_tokens=4",
                 "rollout.max_lora_rank=8", "train.eval_examples=2", "train.lr=1e30", "train.grad_clip=1e30"]
    command = [sys.executable, "-m", "graft.cli", "train", "--run-dir", str(tmp_path / "run")]
    result = subprocess.run(command + [a for o in overrides for a in ("-o", o)], capture_output=True, text=True,
                            timeout=600)
    errors = [line for line in result.stderr.splitlines() if line.startswith("graft: error:")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-3000:]
    assert "not published" in errors[0] and "Traceback" not in result.stderr
    refused = int(errors[0].split("policy version ", 1)[1].split()[0])

    async def server_state():
        async with VllmClient(vllm_server.url) as client:
            served = await client.list_adapters()
            params = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
            base = await client.generate([GenerateRequest((5, 6, 7), params)])
            for name in served:  # the suite's server must be left clean
                await client.unload_adapter(name)
            return served, base

    served, base = asyncio.run(server_state())
    # The last good version is still served, and only it: the older ones of the retention window
    # were unloaded on the way out (with zero rewards the first update only decays the weights, so
    # it may be v0 or v1 that was last good; the refused one never arrived).
    assert refused >= 1 and served == [f"diverged-v{refused - 1}"]
    assert len(base[0][0].token_ids) == 4 and all(x == x for x in base[0][0].logprobs)  # finite, no NaN


_TINY_RUN = ["rollout.engine=reference", "train.batch_prompts=1", "rollout.n_samples=2", "rollout.max_new_tokens=2",
             "train.eval_examples=1", "lora.rank=4"]


def test_a_run_dir_that_is_a_file_or_under_one_or_in_use_is_one_clear_error(base_dir, tmp_path):
    import fcntl

    from graft.train.trainer import RunDirError

    config = load_config(None, [f"model.path={base_dir}", *_TINY_RUN, "train.steps=1"])
    (tmp_path / "file").write_text("not a directory")
    for run_dir in (tmp_path / "file", tmp_path / "file" / "run"):
        with pytest.raises(RunDirError, match="is a file"):
            asyncio.run(train(config, run_dir))
    busy = tmp_path / "busy"
    busy.mkdir()
    with open(busy / ".lock", "w") as held:  # another trainer holds the run dir
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("pid 4242\n")
        held.flush()
        with pytest.raises(RunDirError, match=r"in use by another graft process \(pid 4242\)"):
            asyncio.run(train(config, busy))
    assert sorted(p.name for p in busy.iterdir()) == [".lock"]  # nothing written while refused
    asyncio.run(train(config, busy))  # the holder is gone: the lock is free again


def test_resume_falls_back_past_a_damaged_checkpoint(base_dir, tmp_path):
    overrides = [f"model.path={base_dir}", *_TINY_RUN, "train.checkpoint_every=1", "train.keep_checkpoints=0"]
    asyncio.run(train(load_config(None, [*overrides, "train.steps=3"]), tmp_path))
    state = tmp_path / "checkpoints" / "step-000003" / "trainer_state.json"
    damaged = json.loads(state.read_text())
    del damaged["policy_version"]
    state.write_text(json.dumps(damaged))
    result = asyncio.run(train(load_config(None, [*overrides, "train.steps=4"]), tmp_path, resume=True))
    assert result["resumed_from"] == 2
    assert [r["step"] for r in _rows(tmp_path)] == [1, 2, 3, 4]


def test_runs_sharing_a_sync_dir_never_discard_each_others_versions(base_dir, tmp_path):
    shared = tmp_path / "shared"
    for name in ("first", "second"):
        config = load_config(None, [f"model.path={base_dir}", *_TINY_RUN, "train.steps=2", f"sync.dir={shared}",
                                    f"lora.name={name}", "sync.keep_versions=0"])
        asyncio.run(train(config, tmp_path / name))
    for name in ("first", "second"):
        assert sorted(p.name for p in (shared / name).glob("adapter-v*.ready")) == [
            f"adapter-v00000{v}.ready" for v in (0, 1, 2)]


def _assert_no_batch_before_its_check(events: list[tuple]) -> None:
    """Every update's batch comes from a version whose check had passed when the update began."""
    checked: set[int] = set()
    for event in events:
        if event[0] == "checked":
            checked.add(event[1])
        else:
            assert event[2] in checked, (event, sorted(checked))


def test_the_next_rollout_starts_beside_the_delivery_check_which_still_gates_its_batch(base_dir, tmp_path,
                                                                                       monkeypatch):
    """On-policy, the check of version v runs while step v+1's batch is sampled from v (its probe
    shares the engine's steps); overlapped, it may run beside the next update, but no batch is learned
    from before its version's check passed; a failed check stops the run before a batch of its
    version is trained on."""
    from graft.sync import policy_sync
    from graft.sync.verify import DeliveryError
    from graft.train import batch_maker
    from graft.train.policy import PolicyState

    sampling, learned, checked_before, events = {}, [], [], []
    real_build, real_learn = batch_maker.build_rollout_batch, PolicyState.learn

    async def build(*args, version, **kwargs):
        sampling.setdefault(version, asyncio.Event()).set()
        return await real_build(*args, version=version, **kwargs)

    def learn(self, batch, step):
        learned.append(step)
        events.append(("learn", step, batch.version))
        return real_learn(self, batch, step)

    async def check(engine, source, *, adapter, requested, tolerance, warn_only):
        version = int(adapter.rsplit("-v", 1)[1])
        if not overlapped and 1 <= version < 3:  # a version a later step samples from
            await asyncio.wait_for(sampling.setdefault(version, asyncio.Event()).wait(), timeout=30)
        checked_before.append((version, list(learned), version in sampling))
        events.append(("checked", version))
        if version == failing:
            raise DeliveryError("probe gap", address="reference")
        return 0.0

    monkeypatch.setattr(batch_maker, "build_rollout_batch", build)
    monkeypatch.setattr(PolicyState, "learn", learn)
    monkeypatch.setattr(policy_sync, "verify_delivery", check)
    overrides = [f"model.path={base_dir}", *_TINY_RUN, "train.steps=3"]
    failing, overlapped = None, False
    asyncio.run(train(load_config(None, overrides), tmp_path / "ok"))
    assert learned == [1, 2, 3] and [r["policy_version"] for r in _rows(tmp_path / "ok")] == [1, 2, 3]

    # On-policy every check ended before the next update.
    assert [(v, done) for v, done, _ in checked_before[1:]] == [(1, [1]), (2, [1, 2]), (3, [1, 2, 3])]
    _assert_no_batch_before_its_check(events)
    overlapped, learned[:], checked_before[:], events[:] = True, [], [], []
    sampling.clear()
    asyncio.run(train(load_config(None, [*overrides, "rollout.max_staleness=1"]), tmp_path / "overlapped"))
    assert learned == [1, 2, 3] and [r["step"] for r in _rows(tmp_path / "overlapped")] == [1, 2, 3]
    _assert_no_batch_before_its_check(events)
    overlapped = False

    failing, learned[:] = 1, []
    sampling.clear()
    with pytest.raises(DeliveryError, match="probe gap"):
        asyncio.run(train(load_config(None, overrides), tmp_path / "failed"))
    assert learned == [1] and 1 in sampling  # version 1's batch was sampled, never trained on
