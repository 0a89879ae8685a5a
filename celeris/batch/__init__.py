"""Batch jobs over the OpenAI-compatible serving layer: crash-safe JSONL in, OpenAI Batch JSONL out.

``celeris batch run IN.jsonl OUT.jsonl`` runs (or resumes) a job, ``celeris batch report OUT.jsonl``
checks its results; ``--backend ray`` spreads the same job over a Ray actor pool.
"""

from celeris.batch.jobs import BatchError, ChangedInputError, DuplicateIdError, run_batch

__all__ = ["BatchError", "ChangedInputError", "DuplicateIdError", "run_batch"]
