"""graft.rollout.api_key: where the servers' key is read from. How clients send it and report a
refusal is in test_client_timeouts_and_auth.py; how a launched vLLM gets it, in vllm/test_launcher.py."""

import pytest

from graft.config import ConfigError, load_config
from graft.rollout.api_key import resolve_api_key


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
    monkeypatch.delenv("VLLM_API_KEY")
    # graft saves every default into RUN_DIR/config.yaml: the reloaded run means no key, as the original did.
    assert resolve_api_key(load_config(None, ["rollout.api_key_env=VLLM_API_KEY"]).rollout) is None

