"""The one rewriter of the docs' generated blocks: a stale block is named with its file, an opening
marker without its closing one is an error, and a rewritten file is left alone the second time."""

import pytest

from graft.config.docs_blocks import BlockKind, rewrite, update

GREETINGS = BlockKind("greeting", r"<!-- hello:(?P<name>\w+) -->", "<!-- /hello:(?P=name) -->",
                      lambda name: f"hello, {name}\n", "make greet")


def _page(tmp_path, text):
    page = tmp_path / "page.md"
    page.write_text(text)
    return page


def test_a_stale_block_is_named_with_its_file_and_rewritten(tmp_path):
    page = _page(tmp_path, "a\n<!-- hello:ann -->\nhello, ann\n<!-- /hello:ann -->\n"
                           "<!-- hello:bob -->\nold\n<!-- /hello:bob -->\nz\n")
    (stale,) = update([page], [GREETINGS], check=True)
    assert (stale.path, stale.name) == (page, "bob")
    assert stale.describe(rewritten=False) == f"{page}: greeting block 'bob' is stale; run make greet"
    assert "old" in page.read_text()
    assert [block.name for block in update([page], [GREETINGS], check=False)] == ["bob"]
    assert page.read_text() == ("a\n<!-- hello:ann -->\nhello, ann\n<!-- /hello:ann -->\n"
                                "<!-- hello:bob -->\nhello, bob\n<!-- /hello:bob -->\nz\n")


def test_rewriting_is_idempotent(tmp_path):
    once, _ = rewrite("<!-- hello:ann -->\n<!-- /hello:ann -->\n", GREETINGS)
    assert rewrite(once, GREETINGS) == (once, [])
    page = _page(tmp_path, once)
    assert update([page], [GREETINGS], check=True) == []


def test_an_opening_marker_without_its_closing_marker_is_an_error(tmp_path):
    page = _page(tmp_path, "<!-- hello:ann -->\nhello, ann\n<!-- /hello:bob -->\n")
    with pytest.raises(ValueError, match=f"{page}: greeting block 'ann' has no closing marker"):
        update([page], [GREETINGS], check=True)


def test_a_file_without_blocks_is_left_as_it_is(tmp_path):
    page = _page(tmp_path, "no blocks\n")
    assert update([page], [GREETINGS], check=False) == []
    assert page.read_text() == "no blocks\n"
