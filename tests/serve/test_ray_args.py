"""ServeArgs (the Ray Serve app builder's arguments) -> Ray Serve deployment options, without starting Ray."""

from __future__ import annotations

import importlib.util

import pytest
from pydantic import ValidationError

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="Ray is not installed")


@pytest.fixture(scope="module")
def serve_args() -> type:
    """``celeris.serve.ray.ServeArgs``, imported when a test runs: the module imports Ray Serve (~1.5 s), which
    collection would pay in every xdist worker."""
    pytest.importorskip("ray.serve")
    from celeris.serve.ray import ServeArgs

    return ServeArgs


def test_fixed_replicas_take_their_limits_from_the_engine_queue(serve_args):
    options = serve_args(num_replicas=3, max_num_seqs=4, max_waiting=12, num_cpus_per_replica=2).deployment_options()
    assert options["num_replicas"] == 3 and "autoscaling_config" not in options
    assert options["max_ongoing_requests"] == 16  # max_num_seqs + max_waiting: what one engine admits
    assert options["max_queued_requests"] == 48  # as many as all replicas hold
    assert options["ray_actor_options"] == {"num_cpus": 2, "num_gpus": 0}


def test_autoscaling_uses_ray_serve_names_and_builder_strings(serve_args):
    args = serve_args.model_validate({"min_replicas": "1", "max_replicas": "4", "max_num_seqs": "8"})
    config = args.deployment_options()["autoscaling_config"]
    assert config == {"min_replicas": 1, "max_replicas": 4, "initial_replicas": 1, "target_ongoing_requests": 4.0}
    assert "num_replicas" not in args.deployment_options()


@pytest.mark.parametrize("bad", [{"num_replicas": 0}, {"min_replicas": 3, "max_replicas": 2},
                                 {"num_replicas": 5, "max_replicas": 4}, {"num_gpus_per_replica": -1},
                                 {"unknown": 1}])
def test_bad_arguments_are_refused(bad, serve_args):
    with pytest.raises(ValidationError):
        serve_args.model_validate(bad)
