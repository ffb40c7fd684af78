import asyncio

import pytest

from graft.config import ConfigError, load_config
from graft.rollout.engine import GenerateRequest, SamplingParams
from graft.rollout.factory import open_engine, resolve_api_key
from graft.rollout.pool import EnginePool
from graft.rollout.reference import ReferenceEngine
from graft.rollout.vllm_client import VllmClient
from graft.rollout.vllm_launcher import free_port


def test_a_missing_model_path_is_named_before_anything_starts(tmp_path):
    async def scenario(config):
        async with open_engine(config, tmp_path):
            raise AssertionError("no engine may open without model.path")

    for overrides, message in ([[], "model.path is required to launch vLLM"],
                               [["rollout.engine=reference"], "model.path is required to load the model"]):
        with pytest.raises(ConfigError, match=message):
            asyncio.run(scenario(load_config(None, overrides)))
    assert not (tmp_path / "logs").exists()


def test_reference_engine_from_config(base_dir, tmp_path):
    config = load_config(None, [f"model.path={base_dir}", "rollout.engine=reference"])

    async def scenario():
        async with open_engine(config, tmp_path) as engine:
            assert isinstance(engine, ReferenceEngine)
            out = await engine.generate([GenerateRequest((1, 2, 3), SamplingParams(temperature=0, max_new_tokens=4,
                                                                                   ignore_eos=True))])
            assert len(out[0][0].token_ids) == 4

    asyncio.run(scenario())


@pytest.mark.vllm
def test_user_urls_give_a_client_or_a_pool(vllm_server, base_dir, tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"

    async def scenario():
        one = load_config(None, [f"model.path={base_dir}", f"rollout.urls=[{vllm_server.url}]"])
        async with open_engine(one, tmp_path) as engine:
            assert isinstance(engine, VllmClient) and (await engine.health()).healthy
        two = load_config(None, [f"model.path={base_dir}", f"rollout.urls=[{vllm_server.url},{dead}]"])
        async with open_engine(two, tmp_path) as engine:
            assert isinstance(engine, EnginePool)
            assert {h.address: h.healthy for h in await engine.health_all()} == {vllm_server.url: True, dead: False}

    asyncio.run(scenario())


def test_the_api_key_comes_from_the_config_or_the_environment_variable_it_names(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert resolve_api_key(load_config().rollout) is None  # default variable unset: no key
    monkeypatch.setenv("VLLM_API_KEY", "sk-from-vllm-var")
    assert resolve_api_key(load_config().rollout) == "sk-from-vllm-var"  # what a launched vLLM also reads
    monkeypatch.setenv("MY_KEY", "sk-mine")
    assert resolve_api_key(load_config(None, ["rollout.api_key_env=MY_KEY"]).rollout) == "sk-mine"
    assert resolve_api_key(load_config(None, ["rollout.api_key=sk-literal"]).rollout) == "sk-literal"
    assert resolve_api_key(load_config(None, ["rollout.api_key_env=null"]).rollout) is None
    with pytest.raises(ConfigError, match="rollout.api_key_env names the environment variable NOT_SET_KEY, which "
                                          "is not set"):
        resolve_api_key(load_config(None, ["rollout.api_key_env=NOT_SET_KEY"]).rollout)

