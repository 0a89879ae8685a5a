"""The modules moved in issue 25's small rooms keep their old import paths for one release."""

from __future__ import annotations

import subprocess
import sys

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


def test_old_paths_are_the_moved_modules_with_a_deprecation_warning():
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_the_old_loadtest_path_still_runs_as_a_script():
    done = subprocess.run([sys.executable, "-W", "ignore::DeprecationWarning", "-m", "celeris.serve.loadtest",
                           "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "--concurrency" in done.stdout, done.stderr
