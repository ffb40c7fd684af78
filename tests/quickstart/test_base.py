"""The quickstart's pieces: its settings are configs/quickstart.yaml's, its base model is cached."""

from pathlib import Path

from rich.console import Console

from graft.config import load_config
from graft.quickstart import base as quickstart

REPO = Path(__file__).parents[2]


def test_quickstart_runs_what_configs_quickstart_yaml_says(tmp_path):
    shipped = load_config(REPO / "configs" / "quickstart.yaml", [f"model.path={tmp_path}", "train.seed=3"])
    assert quickstart.quickstart_config(tmp_path, seed=3) == shipped
    assert quickstart.quickstart_config(tmp_path, seed=3, steps=7).train.steps == 7


def test_base_model_is_built_once_per_arguments(tmp_path, monkeypatch):
    monkeypatch.setattr(quickstart, "SFT_ARGS", {"hidden": 64, "layers": 1, "steps": 3, "batch": 4, "lr": 1e-3,
                                                 "target_accuracy": None, "progress": False})
    console = Console(file=open(tmp_path / "out.txt", "w"))
    first, built = quickstart.cached_base_model(0, tmp_path / "cache", console)
    assert built and (first / "sft.json").is_file()
    again, built_again = quickstart.cached_base_model(0, tmp_path / "cache", console)
    other, _ = quickstart.cached_base_model(1, tmp_path / "cache", console)
    assert again == first and not built_again and other != first
