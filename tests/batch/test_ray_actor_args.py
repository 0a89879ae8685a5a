"""The Ray batch actor and runner take the engine settings as ``**llm_kwargs`` (EngineConfig's fields), without
starting Ray: the actor is built in this process, and a bad setting is refused before Ray would start."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="Ray is not installed")


def test_actor_builds_its_engine_from_the_engine_settings(batch_checkpoint, monkeypatch):
    import torch

    from celeris.batch.ray_runner import ServingActor

    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # the actor's own threads, not this process's
    actor = ServingActor(model=str(batch_checkpoint), request_timeout=30.0, served_model_name=None,
                         max_num_seqs=3, device="cpu", dtype="float32", max_model_len=64)
    try:
        config = actor.serving.llm.engine_config
        assert (config.max_num_seqs, config.max_waiting, config.dtype, config.max_model_len) == (3, 64, "float32", 64)
    finally:
        actor.serving.stop()
        actor.serving = None


def test_runner_refuses_a_bad_engine_setting_before_ray_starts(tmp_path):
    from celeris.batch.jobs import BatchError
    from celeris.batch.ray_runner import run_batch_ray

    with pytest.raises(BatchError, match="max_model_len must be >= 1"):
        run_batch_ray(tmp_path / "in.jsonl", tmp_path / "out.jsonl", model=None, max_model_len=0)
    with pytest.raises(BatchError, match="max_num_seqs must be >= 1"):
        run_batch_ray(tmp_path / "in.jsonl", tmp_path / "out.jsonl", model=None, max_num_seqs=0)
