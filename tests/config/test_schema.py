"""graft.config.schema: the config tree and its validators (cross-field checks name their keys)."""


import pytest

from graft.config import (
    ConfigError,
    DataConfig,
    GraftConfig,
    SyncConfig,
    load_config,
)
from tests.config.common import config_error as _error
from tests.config.common import write_config as _write


def test_defaults_are_valid():
    cfg = GraftConfig()
    assert cfg.lora.name == "graft" and cfg.lora.rank == 8 and cfg.lora.target_modules == "all-linear"
    assert cfg.rollout.engine == "vllm" and cfg.rollout.max_lora_rank == 16
    assert cfg.sync.keep_versions == "auto" and cfg.data.task == "arithmetic" and cfg.data.path is None
    assert load_config() == cfg


def test_adv_std_defaults_to_population_and_takes_sample_only():
    assert GraftConfig().train.adv_std == "population"
    assert load_config(None, ["train.adv_std=sample"]).train.adv_std == "sample"
    assert _error(overrides=["train.adv_std=unbiased"]).startswith("train.adv_std: Input should be 'population' or")


def test_rank_above_max_lora_rank_rejected():
    msg = _error(overrides=["lora.rank=32", "rollout.max_lora_rank=16"])
    assert msg.startswith("lora.rank (32) exceeds rollout.max_lora_rank (16)")
    assert "Value error" not in msg


def test_rank_above_max_lora_rank_allowed_in_merged_mode():
    cfg = load_config(overrides=["lora.rank=32", "rollout.max_lora_rank=16", "sync.mode=merged"])
    assert cfg.lora.rank == 32


def test_max_lora_rank_must_be_a_vllm_value():
    msg = _error(overrides=["rollout.max_lora_rank=24"])
    assert msg.startswith("rollout.max_lora_rank:") and "320" in msg and "24" in msg
    assert load_config(overrides=["rollout.max_lora_rank=320", "lora.rank=320"]).rollout.max_lora_rank == 320


def test_keep_versions_above_max_loras_rejected():
    msg = _error(overrides=["sync.keep_versions=5", "rollout.max_loras=4"])
    assert msg.startswith("sync.keep_versions (5) exceeds rollout.max_loras (4)")


def test_auto_keep_versions_above_max_loras_rejected_and_explained():
    msg = _error(overrides=["rollout.max_staleness=3", "rollout.max_loras=4"])
    assert "sync.keep_versions" in msg and "rollout.max_loras (4)" in msg
    assert "max_staleness + 2 = 5" in msg
    assert load_config(overrides=["rollout.max_staleness=2", "rollout.max_loras=4"]).sync.keep_versions == "auto"


def test_keep_versions_zero_never_unloads_so_any_max_loras_works():
    cfg = load_config(overrides=["sync.keep_versions=0", "rollout.max_loras=1"])
    assert cfg.sync.keep_versions == 0 and cfg.sync.resolved_keep_versions(cfg.rollout.max_staleness) == 0


def test_keep_versions_rejects_negative_and_junk():
    assert _error(overrides=["sync.keep_versions=-1"]).startswith("sync.keep_versions:")
    assert _error(overrides=["sync.keep_versions=sometimes"]).startswith("sync.keep_versions:")


def test_resolved_keep_versions():
    assert SyncConfig().resolved_keep_versions(0) == 2
    assert SyncConfig().resolved_keep_versions(3) == 5
    assert SyncConfig(keep_versions=7).resolved_keep_versions(3) == 7


def test_target_modules_forms():
    assert load_config(overrides=["lora.target_modules=q_proj"]).lora.target_modules == ["q_proj"]
    assert load_config(overrides=["lora.exclude_modules=lm_head"]).lora.exclude_modules == ["lm_head"]
    kept = load_config(overrides=["lora.target_modules=[q_proj, k_proj, v_proj]"]).lora.target_modules
    assert kept == ["q_proj", "k_proj", "v_proj"]
    assert _error(overrides=["lora.target_modules=[]"]).startswith("lora.target_modules:")


def test_bad_lora_name_rejected():
    for bad in ["bad name", "-lead", "a/b"]:
        assert _error(overrides=[f"lora.name={bad}"]).startswith("lora.name:")
    assert load_config(overrides=["lora.name=Run_1.a-b"]).lora.name == "Run_1.a-b"


def test_data_path_alone_replaces_default_task(tmp_path):
    cfg = load_config(_write(tmp_path, "data: {path: train.jsonl}\n"))
    assert cfg.data.task is None and cfg.data.path == "train.jsonl"


def test_data_task_and_path_both_set_rejected():
    msg = _error(overrides=["data.task=arithmetic", "data.path=train.jsonl"])
    assert "data.task" in msg and "data.path" in msg and "train.jsonl" in msg


def test_data_task_and_path_both_null_rejected():
    msg = _error(overrides=["data.task=null"])
    assert "data.task" in msg and "data.path" in msg
    with pytest.raises(ValueError):
        DataConfig(task=None)


@pytest.mark.parametrize("overrides, message", [
    (["rollout.engine=sglang", "rollout.launch=false"], "no SGLang server to talk to"),
    (["rollout.launch=false"], "no vLLM server to talk to"),
    (["rollout.engine=reference", "rollout.urls=[http://127.0.0.1:1]"], "in-process, no server"),
    (["sync.mode=full"], "graft trains a LoRA adapter"),
    (["sync.mode=auto"], "not offered yet"),
    (["sync.mode=merged", "rollout.urls=[http://inference-node-7:8000]"], "cannot read: set sync.dir"),
])
def test_impossible_engine_and_sync_settings_are_config_errors_naming_their_origin(overrides, message):
    with pytest.raises(ConfigError, match=message) as error:
        load_config(None, overrides)
    origin = str(error.value).rsplit(" (from override ", 1)[1]
    assert origin.endswith(")") and sorted(origin[:-1].split(", ")) == sorted(repr(o) for o in overrides)


def test_merged_sync_to_a_remote_engine_is_fine_with_a_shared_dir():
    config = load_config(None, ["sync.mode=merged", "rollout.urls=[http://inference-node-7:8000]",
                                "sync.dir=/shared/weights"])
    assert config.sync.dir == "/shared/weights"


@pytest.mark.parametrize("url, hint", [
    ("127.0.0.1:8000", " (did you mean 'http://127.0.0.1:8000'?)"),
    ("localhost:8000", " (did you mean 'http://localhost:8000'?)"),
    ("ftp://host:21", ""),
    ("http://", ""),
])
def test_rollout_urls_need_an_http_scheme_and_a_host(url, hint):
    message = _error(overrides=[f"rollout.urls=[http://ok:8000,{url}]"])
    assert message.startswith(f"rollout.urls: {url!r} is not an http:// or https:// URL with a host{hint}")
    assert len(message.splitlines()) == 1


def test_rollout_urls_port_must_be_a_number():
    assert "'http://a:80x' has a port that is not a number" in _error(overrides=["rollout.urls=[http://a:80x]"])


def test_rollout_urls_accept_http_and_https():
    config = load_config(None, ["rollout.urls=[http://10.0.0.1:8000,https://vllm.example.org]"])
    assert config.rollout.urls == ["http://10.0.0.1:8000", "https://vllm.example.org"]


def test_max_model_len_defaults_to_2048_and_null_means_the_model_limit():
    assert GraftConfig().rollout.max_model_len == 2048
    assert load_config(None, ["rollout.max_model_len=null"]).rollout.max_model_len is None


def test_completions_must_fit_the_launched_server_context():
    message = _error(overrides=["rollout.max_new_tokens=2048"])
    assert message.startswith("rollout.max_new_tokens (2048) leaves no room for the prompt in "
                              "rollout.max_model_len (2048)")
    # The user's own servers and the model's own limit are not graft's to judge here.
    load_config(None, ["rollout.max_new_tokens=4096", "rollout.urls=[http://a:8000]"])
    load_config(None, ["rollout.max_new_tokens=4096", "rollout.max_model_len=null"])
