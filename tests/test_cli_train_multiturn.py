"""`graft train` with a multi-turn environment of the user's own: bad input is one `graft: error:` line
and rc 2 before any engine starts; a user environment in a file outside the package trains on real
vLLM, the engine's log-probs of the model's tokens matching the trainer's (fp32, <= 1e-4); and with
`max_staleness: 1` the server, polled during the run, lists every version an episode is using for as
long as it runs, and never more than keep_versions of the run's adapters."""

import contextlib
import json
import textwrap
import threading
import time

import httpx
import pytest

from graft.cli import main
from graft.sync.adapter import adapter_version
from graft.sync.inflight import InFlightVersions

USER_ENV = textwrap.dedent('''
    import asyncio

    class Hotter:
        """"hotter"/"colder" replies until a turn of even length; the reward falls with each turn."""

        def reset(self, example):
            self.turns = 0
            return [{"role": "user", "content": example.prompt}]

        async def step(self, model_text):
            await asyncio.sleep(0.01)  # a slow tool: turns of different episodes interleave
            self.turns += 1
            if self.turns > 1 and len(model_text) % 2 == 0:  # never at once; cut by max_turns now and then
                return [], 1.0 / self.turns, True
            return [{"role": "user", "content": "Colder." if self.turns % 2 else "Hotter."}], 0.0, False

    class Broken:
        def reset(self):
            return []

        def step(self, model_text):
            return None
''')


def _train(tmp_path, base_dir, *overrides):
    args = ["train", "-o", f"model.path={base_dir}", "-o", "data.task=arithmetic", "-o", "data.env=my_env.py:Hotter",
            "-o", "data.max_turns=3", "-o", "data.max_episode_tokens=200", "--run-dir", str(tmp_path / "run")]
    for override in overrides:
        args += ["-o", override]
    return main(args)


@pytest.mark.parametrize("override, error", [
    ("data.env=my_env.py:Nothing", "data.env: my_env.py has no class or function 'Nothing' (its classes: "
                                   "['Broken', 'Hotter'])"),
    ("data.env=missing_pkg.envs:Env", "data.env: cannot import 'missing_pkg.envs' (No module named 'missing_pkg')"),
    ("data.env=my_env.py:Broken", "data.env: environment 'my_env.py:Broken' has reset(self), which does not take "
                                  "one argument"),
    ("data.reward=math", "data.env ('my_env.py:Hotter') scores its episodes itself: set data.reward to null"),
])
def test_bad_input_is_one_line_and_rc_2_before_any_engine_starts(base_dir, tmp_path, monkeypatch, capsys, override,
                                                                   error):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_env.py").write_text(USER_ENV)
    code = _train(tmp_path, base_dir, override)  # the default engine is a vLLM server graft would launch
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("graft: error: " + error), err
    assert not (tmp_path / "run" / "logs").exists()


def _rows(tmp_path):
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.vllm
def test_a_user_environment_trains_on_vllm_with_the_engines_logprobs(vllm_server, base_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_env.py").write_text(USER_ENV)
    assert _train(tmp_path, base_dir, f"rollout.urls=[{vllm_server.url}]", "train.steps=3", "train.batch_prompts=2",
                  "rollout.n_samples=4", "rollout.max_new_tokens=6", "train.eval_examples=2",
                  "train.kl_coef=0.01") == 0
    rows = _rows(tmp_path)
    assert [r["policy_version"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert row["logprob_abs_diff_max"] <= 1e-4, row  # fp32 vLLM vs the trainer, the model's tokens only
        assert row["episode_turns_mean"] > 1 and row["rollout_tokens"] > row["episode_model_tokens_mean"] * 8
    assert any(r["truncated_fraction"] > 0 for r in rows)


class _Poller(threading.Thread):
    """Lists the server's adapters as fast as it answers: (sent, received, names) per poll."""

    def __init__(self, url):
        super().__init__(daemon=True)
        self.url, self.polls, self.stop = url, [], threading.Event()

    def run(self):
        with httpx.Client(base_url=self.url, timeout=30) as client:
            while not self.stop.is_set():
                sent = time.monotonic()
                names = [m["id"] for m in client.get("/v1/models").json()["data"]]
                self.polls.append((sent, time.monotonic(), names))


@pytest.mark.vllm
def test_staleness_one_never_unloads_a_version_an_episode_is_using(vllm_server, base_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_env.py").write_text(USER_ENV)
    leases, real_use = [], InFlightVersions.use

    @contextlib.asynccontextmanager
    async def recorded_use(self, version):  # every lease: an episode (or a request) on `version`, start and end
        async with real_use(self, version):
            start = time.monotonic()
            try:
                yield
            finally:
                leases.append((version, start, time.monotonic()))

    monkeypatch.setattr(InFlightVersions, "use", recorded_use)
    poller = _Poller(vllm_server.url)
    poller.start()
    try:
        code = _train(tmp_path, base_dir, f"rollout.urls=[{vllm_server.url}]", "rollout.max_staleness=1",
                      "train.tis_cap=2.0", "train.steps=6", "train.batch_prompts=2", "rollout.n_samples=4",
                      "rollout.max_new_tokens=6", "train.eval_examples=2")
    finally:
        poller.stop.set()
        poller.join()
    assert code == 0
    rows = _rows(tmp_path)
    assert any(r["staleness_max"] == 1 for r in rows) and all(r["staleness_max"] in (0, 1) for r in rows)
    assert len(leases) >= 6 * 8 and len(poller.polls) > 20
    checked = 0
    for version, start, end in leases:
        for sent, received, names in poller.polls:
            if start <= sent and received <= end:  # the whole poll fell inside the episode
                assert f"graft-v{version}" in names, (version, names)
                checked += 1
    assert checked > 0
    loaded = [sum(adapter_version("graft", n) is not None for n in names) for _, _, names in poller.polls]
    # keep_versions (auto = max_staleness + 2) = 3, and one more for a moment while a new version loads
    # into the free slot before the oldest leaves: never more than max_loras (4).
    assert max(loaded) <= 4


def test_graft_eval_of_an_environment_reports_its_greedy_episodes_mean_reward(base_dir, tmp_path, monkeypatch,
                                                                             capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_env.py").write_text(USER_ENV)
    common = ["-o", f"model.path={base_dir}", "-o", "rollout.engine=reference", "-o", "train.eval_examples=3",
              "-o", "rollout.max_new_tokens=3", "-o", "data.task=arithmetic", "-o", "data.env=my_env.py:Hotter",
              "--run-dir", str(tmp_path / "run")]
    assert main(["eval", *common, "--json", str(tmp_path / "a.json")]) == 0
    assert main(["eval", *common, "--json", str(tmp_path / "b.json")]) == 0
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("a.json", "b.json"))
    assert a["examples"] == 3 and a["accuracy"] == b["accuracy"]  # greedy episodes: the same every time
    assert main(["config", "-o", "data.env=my_env.py:Broken"]) == 2  # graft config resolves the environment too
