"""The modules moved in issue 25's small rooms keep their old import paths for one release.

Both checks run in a child interpreter (this one has imported everything), the one tests/test_imports.py uses too
(``tests.fixtures.fresh_interpreter``): first the old load-test path as a script (``runpy``, what
``python -m celeris.serve.loadtest`` runs), then the first import of each old path."""

from __future__ import annotations

import pytest

from tests.fixtures.fresh_interpreter import fresh_interpreter


@pytest.fixture(scope="module")
def child() -> dict:
    """What the child interpreter found: the script run's exit code and output, and the import checks' result."""
    return fresh_interpreter()


def test_old_paths_are_the_moved_modules_with_a_deprecation_warning(child):
    assert not child["script"]["imported"]  # running it as a script left the first import to the check
    assert child["check"] == "ok", child["check"]


def test_the_old_loadtest_path_still_runs_as_a_script(child):
    assert child["script"]["code"] == 0 and "--concurrency" in child["script"]["stdout"], child
