"""Deprecated path of ``ModelRouter``, kept for one release: it moved to ``celeris.serve.models_router`` (a router
of models, not of HTTP routes: the routes are in ``celeris.serve.app``)."""

from __future__ import annotations

import warnings

from celeris.serve.models_router import ModelRouter

__all__ = ["ModelRouter"]

warnings.warn("celeris.serve.router moved to celeris.serve.models_router; the old path goes in the next release",
              DeprecationWarning, stacklevel=2)
