"""graft.config.schema, rollout section: failover, timeouts and the API key settings."""

import pytest

from graft.config import ConfigError, config_to_yaml, load_config, save_config


def test_failover_and_timeout_defaults():
    rollout = load_config().rollout
    assert (rollout.min_engines, rollout.request_timeout_s, rollout.control_timeout_s) == (1, 1800.0, 30.0)
    assert rollout.api_key is None and rollout.api_key_env == "VLLM_API_KEY"


@pytest.mark.parametrize("overrides, shown", [
    (["rollout.min_engines=3", "rollout.urls=[http://a:8000,http://b:8000]"], "(2: 2 in rollout.urls)"),
    (["rollout.min_engines=2"], "(1: 0 in rollout.urls, or the one graft launches)"),
])
def test_min_engines_above_the_number_of_servers_is_rejected(overrides, shown):
    with pytest.raises(ConfigError) as error:
        load_config(None, overrides)
    message = str(error.value)
    assert message.startswith(f"rollout.min_engines ({overrides[0][-1]}) exceeds the number of servers {shown}")
    assert "from override 'rollout.min_engines=" in message


@pytest.mark.parametrize("override", ["rollout.control_timeout_s=0", "rollout.request_timeout_s=-1",
                                      "rollout.min_engines=0"])
def test_timeouts_and_min_engines_must_be_positive(override):
    with pytest.raises(ConfigError, match=override.split("=")[0]):
        load_config(None, [override])


def test_a_literal_key_is_never_shown_and_both_sources_at_once_are_rejected(tmp_path):
    config = load_config(None, ["rollout.api_key=sk-literal-42"])
    assert config.rollout.api_key.get_secret_value() == "sk-literal-42"
    assert "sk-literal-42" not in config_to_yaml(config) + repr(config) + str(config)
    # Saved and reloaded, the mask is not taken for the key: no literal key, the environment decides.
    save_config(config, tmp_path / "saved.yaml")
    assert load_config(tmp_path / "saved.yaml").rollout.api_key is None
    assert "a key was set" in config_to_yaml(config) and "a key was set" not in config_to_yaml(load_config(None))
    with pytest.raises(ConfigError, match="rollout.api_key and rollout.api_key_env are both set"):
        load_config(None, ["rollout.api_key=sk-literal-42", "rollout.api_key_env=MY_KEY"])
