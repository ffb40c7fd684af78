"""Fixtures of the sync tests."""

import pytest

from tests.helpers import trained_like_peft_model


@pytest.fixture(scope="module")
def peft_model(base_dir):
    return trained_like_peft_model(base_dir, rank=8, seed=1)
