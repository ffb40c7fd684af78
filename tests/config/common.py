"""Helpers the config tests share."""

import pytest

from graft.config import ConfigError, load_config


def write_config(tmp_path, text, name="run.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def config_error(path=None, overrides=()) -> str:
    """The one ConfigError message that loading `path` with `overrides` raises."""
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return str(info.value)
