"""graft.config.loading: YAML + dotted overrides -> validated GraftConfig, errors as one ConfigError line each."""

from pathlib import Path

import pytest

from graft.config import (
    ConfigError,
    GraftConfig,
    config_to_yaml,
    load_config,
    save_config,
)
from tests.config.common import config_error as _error
from tests.config.common import write_config as _write

FULL_YAML = """\
model: {path: /models/tiny, dtype: bfloat16}
lora:
  name: my-run.v2
  rank: 4
  alpha: 8
  dropout: 0.05
  target_modules: [q_proj, v_proj]
  exclude_modules: lm_head
rollout:
  engine: sglang
  urls: [http://a:8000, http://b:8000]
  launch: false
  max_loras: 8
  max_lora_rank: 32
  n_samples: 4
  max_new_tokens: 64
  temperature: 0.7
  top_p: 0.9
  max_staleness: 2
sync: {mode: merged, dir: /tmp/w, keep_versions: 3, verify: false}
train:
  steps: 5
  batch_prompts: 2
  lr: 3.0e-5
  kl_coef: 0.01
  entropy_coef: 0.001
  clip_eps: 0.3
  loss_agg: seq-mean-token-mean
  seed: 7
  grad_clip: 0.5
data: {task: null, path: train.jsonl, eval_path: eval.jsonl, reward: contains}
dist: {backend: gloo}
"""




def test_yaml_sets_every_section(tmp_path):
    cfg = load_config(_write(tmp_path, FULL_YAML))
    assert cfg.model.path == "/models/tiny" and cfg.model.dtype == "bfloat16"
    assert cfg.lora.name == "my-run.v2" and cfg.lora.rank == 4 and cfg.lora.alpha == 8.0
    assert cfg.lora.target_modules == ["q_proj", "v_proj"] and cfg.lora.exclude_modules == ["lm_head"]
    assert cfg.rollout.engine == "sglang" and cfg.rollout.urls == ["http://a:8000", "http://b:8000"]
    assert cfg.rollout.launch is False and cfg.rollout.max_loras == 8 and cfg.rollout.top_p == 0.9
    assert cfg.sync.mode == "merged" and cfg.sync.dir == "/tmp/w" and cfg.sync.keep_versions == 3
    assert cfg.sync.verify is False
    assert cfg.train.lr == 3e-5 and cfg.train.loss_agg == "seq-mean-token-mean" and cfg.train.seed == 7
    assert cfg.data.task is None and cfg.data.path == "train.jsonl" and cfg.data.reward == "contains"
    assert cfg.dist.backend == "gloo"


def test_empty_file_and_null_section_mean_defaults(tmp_path):
    assert load_config(_write(tmp_path, "")) == GraftConfig()
    assert load_config(_write(tmp_path, "lora:\n# rank: 4\n")) == GraftConfig()


def test_overrides_are_parsed_as_yaml():
    cfg = load_config(
        overrides=[
            "lora.rank=16",
            "rollout.launch=false",
            "rollout.urls=[http://127.0.0.1:8000]",
            "lora.target_modules=[q_proj,v_proj]",
            "train.lr=1e-4",
            "sync.mode=merged",
            "model.path=",
        ]
    )
    assert cfg.lora.rank == 16 and isinstance(cfg.lora.rank, int)
    assert cfg.rollout.launch is False
    assert cfg.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.train.lr == 1e-4
    assert cfg.sync.mode == "merged"
    assert cfg.model.path is None  # `key=` means null


def test_override_all_linear_stays_a_string():
    assert load_config(overrides=["lora.target_modules=all-linear"]).lora.target_modules == "all-linear"


def test_override_wins_over_file(tmp_path):
    path = _write(tmp_path, "lora: {rank: 4, alpha: 8}\n")
    cfg = load_config(path, ["lora.rank=8"])
    assert cfg.lora.rank == 8 and cfg.lora.alpha == 8.0


def test_unknown_nested_key_names_full_path_and_file(tmp_path):
    path = _write(tmp_path, "lora: {rnak: 4}\n")
    msg = _error(path)
    assert msg.startswith("unknown config key 'lora.rnak'")
    assert str(path) in msg


def test_unknown_top_level_section(tmp_path):
    assert "unknown config key 'lorra'" in _error(_write(tmp_path, "lorra: {rank: 4}\n"))


def test_unknown_key_via_override():
    msg = _error(overrides=["rollout.max_lora=4"])
    assert "unknown config key 'rollout.max_lora'" in msg and "rollout.max_lora=4" in msg


def test_wrong_type_names_key_without_pydantic_boilerplate():
    msg = _error(overrides=["rollout.n_samples=many"])
    assert msg.startswith("rollout.n_samples: Input should be a valid integer")
    assert "errors.pydantic.dev" not in msg and "validation error" not in msg


def test_range_error_names_key():
    assert _error(overrides=["lora.rank=0"]).startswith("lora.rank: Input should be greater than or equal to 1")


@pytest.mark.parametrize(("override", "line"), [
    ("train.max_tokens_per_micro_batch=0", "train.max_tokens_per_micro_batch: Input should be greater than 0 or "
     "'auto' (got 0) (from override 'train.max_tokens_per_micro_batch=0')"),
    ("train.activation_checkpointing=maybe", "train.activation_checkpointing: Input should be 'auto' or a valid "
     "boolean (got 'maybe') (from override 'train.activation_checkpointing=maybe')"),
])
def test_a_bad_value_of_a_union_typed_setting_is_one_line_at_its_own_key(override, line):
    """pydantic reports one error per member type of the union (`...micro_batch.constrained-int`,
    `...micro_batch.literal['auto']`): one mistake, one line."""
    assert _error(overrides=[override]) == line


def test_two_settings_with_the_same_bad_value_stay_two_errors():
    lines = _error(overrides=["train.steps=x", "train.lr=x"]).splitlines()
    assert [line.split(":")[0] for line in lines] == ["train.steps", "train.lr"]


def test_several_errors_one_line_each_first_first():
    lines = _error(overrides=["lora.rank=0", "train.lr=-1"]).splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("lora.rank:") and lines[1].startswith("train.lr:")


def test_bad_yaml_syntax_names_file_and_line(tmp_path):
    path = _write(tmp_path, "lora:\n  rank: 4\n  alpha: [8\n")
    msg = _error(path)
    assert str(path) in msg and "line " in msg


def test_top_level_must_be_a_mapping(tmp_path):
    assert "mapping" in _error(_write(tmp_path, "- lora\n- rollout\n"))


def test_missing_file():
    assert "cannot read config file" in _error("/nonexistent/graft.yaml")


def test_malformed_overrides():
    assert "bad override 'lora.rank'" in _error(overrides=["lora.rank"])
    assert "bad override '=4'" in _error(overrides=["=4"])
    assert "bad override 'lora..rank=4'" in _error(overrides=["lora..rank=4"])


def test_override_through_a_non_mapping_names_the_key(tmp_path):
    msg = _error(_write(tmp_path, "lora: {rank: 4}\n"), ["lora.rank.x=1"])
    assert "lora.rank" in msg and "lora.rank.x=1" in msg


def test_save_load_round_trip(tmp_path):
    cfg = load_config(_write(tmp_path, FULL_YAML))
    out = tmp_path / "run_dir" / "config.yaml"
    save_config(cfg, out)
    assert load_config(out) == cfg
    assert [p.name for p in out.parent.iterdir()] == ["config.yaml"]  # no temp file left behind
    save_config(GraftConfig(), out)
    assert load_config(out) == GraftConfig()


def test_yaml_keeps_section_order():
    text = config_to_yaml(GraftConfig())
    sections = [line.rstrip(":") for line in text.splitlines() if line and not line.startswith(" ")]
    assert sections == ["model", "lora", "rollout", "sync", "train", "data", "dist"]


def test_every_shipped_config_is_valid_and_shows_its_launch_command():
    configs = sorted((Path(__file__).parents[2] / "configs").glob("*.yaml"))
    assert configs
    for path in configs:
        load_config(path)
        assert "graft " in path.read_text().split("\n\n")[0], f"{path.name}: header lacks the launch command"


def test_a_cross_field_error_names_the_file_and_the_override_it_came_from(tmp_path):
    path = _write(tmp_path, "rollout:\n  engine: sglang\n  launch: false\n")
    with pytest.raises(ConfigError, match=rf"no SGLang server to talk to.*\(in {path}\)$"):
        load_config(path)
    with pytest.raises(ConfigError, match=rf"\(from override 'rollout.urls=\[\]'; in {path}\)$"):
        load_config(path, ["rollout.urls=[]"])


def test_a_group_of_one_sample_is_refused_naming_why():
    """GRPO's advantages compare a prompt's samples: with one per prompt every advantage is 0."""
    assert _error(overrides=["rollout.n_samples=1"]).startswith(
        "rollout.n_samples: must be at least 2: the advantages compare a prompt's samples with each other")
