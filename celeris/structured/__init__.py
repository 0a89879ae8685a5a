"""Constrained decoding: JSON Schema, JSON mode and tool-call grammars as token masks (``grammar``)."""
