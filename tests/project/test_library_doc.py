"""The python blocks of docs/library.md run as written, in order, in one interpreter on 4
host devices (the snippets of "Use it in your model" build on each other)."""

from __future__ import annotations

import re

from tests.support import REPO_ROOT
from tests.support.host_devices import run_on_host_devices

REPO = REPO_ROOT
LIBRARY_DOC = REPO / "docs" / "library.md"
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.DOTALL | re.MULTILINE)


def test_the_library_doc_snippets_run_in_order(tmp_path):
    blocks = PYTHON_BLOCK.findall(LIBRARY_DOC.read_text(encoding="utf-8"))
    assert len(blocks) >= 7, "docs/library.md lost its walk-through (NNX ... x64)"
    run_on_host_devices("\n\n".join(blocks), cwd=tmp_path, timeout=600)
