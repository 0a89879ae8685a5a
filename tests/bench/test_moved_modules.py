"""The modules moved in issue 25's small rooms keep their old import paths for one release.

Both checks run in one child interpreter (this one has imported everything): first the old load-test path as a
script (``runpy``, what ``python -m celeris.serve.loadtest`` runs), then the first import of each old path."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

CHILD = """
import contextlib, io, json, runpy, sys, traceback, warnings
out, code = io.StringIO(), None
with warnings.catch_warnings():  # as `python -W ignore::DeprecationWarning -m celeris.serve.loadtest --help`
    warnings.simplefilter("ignore", DeprecationWarning)
    sys.argv = ["celeris.serve.loadtest", "--help"]
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_module("celeris.serve.loadtest", run_name="__main__", alter_sys=True)
        except SystemExit as exit:
            code = exit.code
script = {"code": code, "stdout": out.getvalue(), "imported": "celeris.serve.loadtest" in sys.modules}
try:
    exec(CHECK)
    check = "ok"
except BaseException:
    check = traceback.format_exc()
print(json.dumps({"script": script, "check": check}))
"""

CHECK = """
import warnings
warnings.simplefilter("error", DeprecationWarning)
try:
    import celeris.serve.loadtest
except DeprecationWarning as w:
    assert "celeris.bench.loadtest" in str(w), w
else:
    raise SystemExit("no DeprecationWarning for celeris.serve.loadtest")
warnings.simplefilter("ignore", DeprecationWarning)
import celeris.bench.loadtest as new
import celeris.serve.loadtest as old
from celeris.serve import loadtest as attr
assert old is new and attr is new, (old, new, attr)
from celeris.serve.models_router import ModelRouter
from celeris.serve.router import ModelRouter as Old
assert Old is ModelRouter
"""


@pytest.fixture(scope="module")
def child() -> dict:
    """What the child interpreter found: the script run's exit code and output, and the import checks' result."""
    done = subprocess.run([sys.executable, "-c", f"CHECK = {CHECK!r}\n{CHILD}"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_old_paths_are_the_moved_modules_with_a_deprecation_warning(child):
    assert not child["script"]["imported"]  # running it as a script left the first import to the check
    assert child["check"] == "ok", child["check"]


def test_the_old_loadtest_path_still_runs_as_a_script(child):
    assert child["script"]["code"] == 0 and "--concurrency" in child["script"]["stdout"], child
