"""Deprecated path of the load-test client, kept for one release: it moved to ``celeris.bench.loadtest``.

``import celeris.serve.loadtest`` gives that very module (monkeypatching either name patches both), and
``python -m celeris.serve.loadtest ...`` still runs it. This shim sits on the bench floor of the import map
(``tests/test_imports.py``), beside the module it names.
"""

from __future__ import annotations

import sys
import warnings

from celeris.bench import loadtest as _loadtest

warnings.warn("celeris.serve.loadtest moved to celeris.bench.loadtest; the old path goes in the next release",
              DeprecationWarning, stacklevel=2)

if __name__ == "__main__":
    sys.exit(_loadtest.main())
sys.modules[__name__] = _loadtest
