"""Every code block of README.md and docs/*.md is a test (tests/_docs.py runs them; Sybil finds them)."""

import pytest

from _docs import sybil

pytest_collect_file = sybil().pytest()


def pytest_collection_modifyitems(items):
    # A doc block runs real commands (launches, studies): slow, as the multi-rank proofs are.
    for item in items:
        if type(item).__name__ == "SybilItem":
            item.add_marker(pytest.mark.slow)
