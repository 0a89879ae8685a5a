"""Deprecated path of the sampling settings, kept for one release: ``SamplingParams`` and its settings moved to
``celeris.sampling.params``, inside the floor that validates them (issue 50: the import map's one arrow back up).

``import celeris.params`` gives that very module (monkeypatching either name patches both). The public face,
``from celeris import SamplingParams``, never went through here. This shim sits in the sampling unit of the import
map (``tests/test_imports.py``), beside the module it names.
"""

from __future__ import annotations

import sys
import warnings

from celeris.sampling import params as _params

warnings.warn("celeris.params moved to celeris.sampling.params; the old path goes in the next release",
              DeprecationWarning, stacklevel=2)

sys.modules[__name__] = _params
