"""The guides (docs/*.md) run as written: tests/test_docs.py's check, in a file of its own so that `make
test-docs` (--dist loadfile) runs them beside README.md's commands, each page in one process, in its order."""

import pytest

from test_docs import ITEMS, Item, check_item, item_id


@pytest.mark.slow
@pytest.mark.parametrize("item", [i for i in ITEMS if i.page != "README.md"], ids=item_id)
def test_the_guides_run_as_written(item: Item, tmp_path_factory, tmp_path):
    check_item(item, tmp_path_factory, tmp_path)
