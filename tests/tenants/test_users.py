"""Users and their keys (graft.tenants.users): a keys file read line by line with one clear error per
bad line (never showing a key), every key compared, `graft tenants serve --keys` refusing a bad file
before anything starts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from graft.tenants.users import Users

ANN, BOB = "tml-ann-0123456789", "tml-bob-9876543210"


def test_a_keys_file_names_each_user_by_their_key(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"# the lab's users\nann {ANN}\n\nbob   {BOB}  # second\n")
    users = Users.from_file(keys)
    assert users.names == ["ann", "bob"]
    assert users.user_of(ANN) == "ann" and users.user_of(BOB) == "bob"
    assert users.user_of(None) is None and users.user_of("") is None
    assert users.user_of(ANN + "x") is None and users.user_of(ANN[:-1]) is None


@pytest.mark.parametrize(("text", "problem"), [
    (f"ann {ANN} extra\n", "line 1: expected '<user> <key>', got 3 fields"),
    (f"ann {ANN}\nann {BOB}\n", "line 2: user 'ann' is named twice"),
    (f"ann {ANN}\nbob {ANN}\n", "two users have the same key"),
    ("ann sk-not-a-tinker-key\n", "line 1: an API key must start with 'tml-'"),
    (f"../etc {ANN}\n", "user name '../etc'"),
    ("# nobody\n", "no users"),
])
def test_a_bad_keys_file_is_one_error_naming_the_line_and_never_the_key(tmp_path, text, problem):
    keys = tmp_path / "keys"
    keys.write_text(text)
    with pytest.raises(ValueError, match=problem.replace("(", r"\(")) as error:
        Users.from_file(keys)
    assert ANN not in str(error.value) and BOB not in str(error.value)


def test_serve_refuses_a_bad_keys_file_before_loading_anything(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("ann\n")
    done = subprocess.run([sys.executable, "-m", "graft.cli", "tenants", "serve", "--model", str(tmp_path / "none"),
                           "--keys", str(keys)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("graft: error: keys file") and "line 1" in done.stderr
