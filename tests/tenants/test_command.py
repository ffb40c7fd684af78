"""`graft tenants serve`: bad input gets one clear error and exit 2 before any server starts."""

import pytest

from graft.cli import main


@pytest.mark.parametrize(("key", "extra", "message"), [
    ("secret-key", [], "must start with 'tml-'"),
    ("tml-fine-key", ["--model", "no/such-model-here"], "neither a local directory nor a model"),
])
def test_bad_input_exits_2_naming_the_problem(monkeypatch, capsys, base_dir, key, extra, message):
    monkeypatch.setenv("TINKER_API_KEY", key)
    args = ["tenants", "serve", "--model", str(base_dir), *extra]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("graft: error: ") and message in err and err.count("\n") == 1


def test_a_keep_versions_of_0_is_refused_when_the_flags_are_parsed(monkeypatch, capsys, base_dir):
    monkeypatch.setenv("TINKER_API_KEY", "tml-fine-key")
    with pytest.raises(SystemExit) as exit_info:
        main(["tenants", "serve", "--model", str(base_dir), "--keep-versions", "0"])
    assert exit_info.value.code == 2
    assert "argument --keep-versions: must be at least 1 (got 0)" in capsys.readouterr().err
