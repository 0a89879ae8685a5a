"""``python -m celeris.cli``: the ``celeris`` command."""

import sys

from celeris.cli import main

sys.exit(main())
