"""The OpenAI server on Ray Serve: one ingress (the FastAPI app) in front of N engine replicas.

    celeris serve --num-replicas 2                       # local Ray, two engines on this machine
    celeris serve --ray-address auto --num-replicas 4    # an existing cluster (``ray start --head``)
    serve run celeris.serve.ray:app model=PATH num_replicas=2      # Ray Serve's own CLI (builder args)
    serve deploy docs/ray-serve.yaml                                # a Serve config file

Deployments of one application (``APP_NAME``):

* ``CelerisEngine`` (N replicas, or autoscaled between ``min_replicas`` and ``max_replicas`` on
  ``target_ongoing_requests``): each loads the checkpoint once and runs its own ``AsyncEngine``
  (continuous batching), with ``num_cpus_per_replica`` torch threads. Its ``generate`` streams the
  ``StepEvent`` lists of one request group; ``max_ongoing_requests`` = ``max_num_seqs + max_waiting``,
  the engine's own admission limit, so Ray Serve's router (power of two choices on queue length)
  never sends a replica more than its engine would accept, and ``max_queued_requests`` bounds the
  router's queue (requests not yet given to a replica; by default as many as all replicas hold; beyond:
  ``BackPressureError``, answered 429). ``check_health`` fails when the
  engine thread died or stalled, so Ray Serve restarts the replica.
* the HTTP side, ``ClusterIngress``: ``create_app`` over an ``OpenAIServing`` whose engine is a
  ``RemoteEngine`` calling the replicas through a deployment handle (see ``celeris.serve.remote`` for
  the failure rules). It loads the checkpoint for its tokenizer and configuration only (the engine
  there never runs). ``celeris serve --num-replicas`` runs it in its own process behind Celeris's own
  server (``run_cluster_server``; Ray Serve's HTTP proxy is not started); ``serve run`` / ``serve
  deploy`` run it as the ``CelerisIngress`` deployment (one replica, no CPU) behind Ray Serve's proxy.
* ``CelerisMetricsBoard`` (one replica, no CPU): every engine replica posts its engine series
  (waiting, running, generations admitted, verified-decoding counters) every ``METRICS_PUSH_S``; the ingress's ``/metrics``
  shows them with a ``replica`` label next to its own HTTP series.

Drain of ``celeris serve --num-replicas``: the port is Celeris's server's, so SIGTERM/SIGINT drains
exactly as the single server does (``celeris.serve.server``): new requests 503 with ``Retry-After``,
``/health`` 503, requests in flight finish within ``drain_timeout_s``, then the rest are cut (a stream
ends with an error event and ``data: [DONE]``); the port closes, and only then is the application
deleted and a local Ray instance stopped, so no request ever meets Ray Serve's 404 for a deleted
application. Under ``serve run`` Ray Serve's CLI owns the signals; ``drain`` applies the same rules to a
``CelerisIngress`` from a script.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Any, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator
from ray import serve
from ray.serve.handle import DeploymentHandle

import celeris
from celeris.config import SERVER_MAX_WAITING, EngineConfig, engine_fields
from celeris.llm import LLM
from celeris.ray_session import LocalRaySession, sigterm_raises
from celeris.serve.async_engine import EngineDeadError, EngineInput
from celeris.serve.metrics import ServerMetrics
from celeris.serve.remote import ACCEPTED, REFUSED, RemoteEngine
from celeris.serve.server import ServerLimits

logger = logging.getLogger(__name__)

APP_NAME = "celeris"
PACKAGE_ROOT = str(Path(celeris.__file__).resolve().parent.parent)
METRICS_PUSH_S = 2.0  # how often an engine replica posts its series to the board
METRICS_STALE_S = 3 * METRICS_PUSH_S  # a replica silent this long (dead, removed) leaves /metrics
REPLICA_SERIES = ("celeris_num_requests_waiting", "celeris_num_requests_running", "celeris_spec_decode_",
                  "celeris_prefix_cache_", "celeris_replica_generations")
STALL_TIMEOUT_S = 30.0  # an engine replica with requests and no step for this long fails its health check


def engine_field_specs(**defaults: object) -> dict[str, tuple[Any, Any]]:
    """Every ``EngineConfig`` field as a pydantic field spec ``(type, Field(default, description=help))`` for
    ``create_model``, the default from ``EngineConfig`` unless ``defaults`` names it."""
    hints = get_type_hints(EngineConfig)
    return {name: (hints[name], Field(defaults.get(name, f.default), description=describe(name)))
            for name, f in engine_fields().items()}


def describe(name: str) -> str:
    """An engine field's help as a description of the field itself: a switch that turns it off (``--compile``
    for ``enforce_eager``) is named, so the text does not read as the True value's meaning."""
    meta = engine_fields()[name].metadata
    return f"False is {meta['flag']}: {meta['help']}" if meta.get("invert") else meta["help"]


class _ServeArgs(BaseModel):
    """The fields of ``ServeArgs`` that are not engine settings (those come from ``EngineConfig``)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    served_model_name: str | None = None
    trust_remote_code: bool = False
    tokenizer: str | None = None
    chat_template: str | None = None
    request_timeout: float = Field(60.0, gt=0)
    api_key: str | None = None
    num_replicas: int = Field(1, ge=1)
    min_replicas: int | None = Field(None, ge=0)
    max_replicas: int | None = Field(None, ge=1)
    target_ongoing_requests: float | None = Field(None, gt=0)
    num_cpus_per_replica: float = Field(1.0, gt=0)
    num_gpus_per_replica: float = Field(0.0, ge=0)
    max_queued_requests: int | None = Field(None, ge=1)
    drain_timeout_s: float = Field(30.0, gt=0)
    body_timeout_s: float = Field(30.0, gt=0)
    max_body_bytes: int = Field(8 << 20, ge=1)

    @model_validator(mode="after")
    def _engine_settings_in_range(self) -> _ServeArgs:
        EngineConfig.from_kwargs(**self.engine_kwargs())  # ValueError naming the field (pydantic's error)
        return self

    def engine_kwargs(self) -> dict[str, Any]:
        """The engine settings (every ``EngineConfig`` field) as keyword arguments for ``LLM``."""
        return {name: getattr(self, name) for name in engine_fields()}

    @model_validator(mode="after")
    def _replicas_in_range(self) -> _ServeArgs:
        low = self.min_replicas if self.min_replicas is not None else 1
        high = self.max_replicas if self.max_replicas is not None else max(low, self.num_replicas)
        if low > high:
            raise ValueError(f"min_replicas ({low}) must not exceed max_replicas ({high})")
        if self.autoscaling and not low <= self.num_replicas <= high:
            raise ValueError(f"num_replicas ({self.num_replicas}) must lie in [min_replicas, max_replicas] = "
                             f"[{low}, {high}] when autoscaling")
        return self

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None or self.target_ongoing_requests is not None

    @property
    def replica_capacity(self) -> int:
        """Generations one engine replica holds (running + waiting): its ``max_ongoing_requests``."""
        return self.max_num_seqs + self.max_waiting

    def deployment_options(self) -> dict[str, Any]:
        """Ray Serve options of the engine deployment."""
        options: dict[str, Any] = {
            "ray_actor_options": {"num_cpus": self.num_cpus_per_replica, "num_gpus": self.num_gpus_per_replica},
            "max_ongoing_requests": self.replica_capacity,
            "max_queued_requests": self.max_queued_requests
            or self.replica_capacity * (self.max_replicas or self.num_replicas),
            "health_check_period_s": 5.0,
            "health_check_timeout_s": 30.0,
            "graceful_shutdown_timeout_s": self.drain_timeout_s,
        }
        if self.autoscaling:
            low = self.min_replicas if self.min_replicas is not None else 1
            options["autoscaling_config"] = {
                "min_replicas": low,
                "max_replicas": self.max_replicas if self.max_replicas is not None else max(low, self.num_replicas),
                "initial_replicas": self.num_replicas,
                "target_ongoing_requests": self.target_ongoing_requests or max(1.0, self.max_num_seqs / 2),
            }
        else:
            options["num_replicas"] = self.num_replicas
        return options


ServeArgs = create_model(
    "ServeArgs", __base__=_ServeArgs, __module__=__name__,
    __doc__="""Arguments of the Ray Serve application (``serve run celeris.serve.ray:app key=value ...``).

    Engine settings are ``EngineConfig``'s fields, each meaning what it means for ``celeris serve`` (and, as
    there, ``max_waiting`` defaults to ``SERVER_MAX_WAITING``); the replica settings use Ray Serve's
    names. Autoscaling is on when ``min_replicas`` or ``max_replicas`` is given (``num_replicas`` is
    then the initial count). Raises pydantic's ``ValidationError`` naming the field at fault.
    """,
    **engine_field_specs(max_waiting=SERVER_MAX_WAITING),
)


# -- metrics ---------------------------------------------------------------------------------------


def collect_series(metrics: ServerMetrics) -> list[tuple]:
    """The engine-side families of ``metrics`` as plain tuples (name, type, help, [(sample, labels, value)])."""
    out = []
    for family in metrics.registry.collect():
        if family.name.startswith(REPLICA_SERIES):
            out.append((family.name, family.type, family.documentation,
                        [(s.name, dict(s.labels), s.value) for s in family.samples]))
    return out


@serve.deployment(name="CelerisMetricsBoard", ray_actor_options={"num_cpus": 0},
                  logging_config={"enable_access_log": False})
class CelerisMetricsBoard:
    """The latest engine series of every replica: ``put`` by replicas, ``snapshot`` by the ingress."""

    def __init__(self) -> None:
        self.series: dict[str, tuple[float, list[tuple]]] = {}

    def put(self, replica: str, series: list[tuple]) -> None:
        self.series[replica] = (time.monotonic(), series)

    def snapshot(self) -> dict[str, list[tuple]]:
        now = time.monotonic()
        self.series = {r: v for r, v in self.series.items() if now - v[0] < METRICS_STALE_S}
        return {r: v[1] for r, v in self.series.items()}


class ClusterMetrics(ServerMetrics):
    """The ingress's metrics: its own HTTP series plus every replica's engine series with a ``replica`` label."""

    def __init__(self) -> None:
        super().__init__()
        for gauge in (self._waiting, self._running):  # the replicas' gauges take their place
            self.registry.unregister(gauge)
        self.replicas: dict[str, list[tuple]] = {}
        self.registry.register(self)

    def watch_drafts(self, engine) -> None:  # noqa: ANN001 - the replicas report their drafters' counters
        return

    def describe(self) -> list:
        return []

    def collect(self):
        from prometheus_client.core import Metric

        families: dict[str, Metric] = {}
        for replica, series in sorted(self.replicas.items()):
            for name, kind, doc, samples in series:
                family = families.setdefault(name, Metric(name, doc, kind))
                for sample, labels, value in samples:
                    family.add_sample(sample, {**labels, "replica": replica}, value)
        yield from families.values()


# -- deployments -----------------------------------------------------------------------------------


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside a replica (tests calling the class directly)
        return f"pid{os.getpid()}"


@serve.deployment(name="CelerisEngine")
class CelerisEngine:
    """One engine replica: loads the checkpoint once, batches its requests continuously (``AsyncEngine``)."""

    def __init__(self, args: dict, board: DeploymentHandle | None = None) -> None:
        import torch
        from prometheus_client import Counter

        from celeris.serve.serving import OpenAIServing

        self.args = ServeArgs.model_validate(args)
        torch.set_num_threads(max(1, int(self.args.num_cpus_per_replica)))  # a replica's threads = its CPUs
        a = self.args
        self.serving = OpenAIServing.from_model(a.model, request_timeout=a.request_timeout,
                                                served_model_name=a.served_model_name,
                                                trust_remote_code=a.trust_remote_code, tokenizer=a.tokenizer,
                                                chat_template=a.chat_template, **a.engine_kwargs())
        self.async_engine = self.serving.async_engine
        self.admitted = Counter("celeris_replica_generations", "Generations (prompts x n) this engine replica admitted",
                                registry=self.serving.metrics.registry)
        self.async_engine.start()
        self.replica_id = _replica_id()
        # per generate() call in flight: answer positions committed so far by each of its unfinished requests
        self._unfinished: dict[int, dict[int, int]] = {}
        self._calls = itertools.count()
        self._stop = threading.Event()
        if board is not None:
            threading.Thread(target=self._push_metrics, args=(board,), daemon=True, name="celeris-metrics").start()

    def _push_metrics(self, board: DeploymentHandle) -> None:
        while not self._stop.wait(METRICS_PUSH_S):
            try:
                board.put.remote(self.replica_id, collect_series(self.serving.metrics)).result(timeout_s=10)
            except Exception as exc:  # the board restarts with the application; try again next period
                logger.debug("metrics push failed: %s", exc)

    async def generate(self, inputs: list[EngineInput], want_canvas: bool = False):
        """Run one group: first ``("accepted", replica id)`` or ``("refused", reason, message)``, then one
        list of ``StepEvent`` per engine step until every request finished. Cancelling the stream aborts
        the group's requests at the next step boundary."""
        from celeris.engine import QueueFullError

        try:
            group = await self.async_engine.submit(inputs, want_canvas)
        except QueueFullError as exc:
            yield (REFUSED, "queue_full", str(exc))
            return
        except ValueError as exc:
            yield (REFUSED, "invalid", str(exc))
            return
        except EngineDeadError as exc:
            yield (REFUSED, "engine_dead", str(exc))
            return
        self.admitted.inc(len(inputs))
        call = next(self._calls)
        unfinished = self._unfinished[call] = dict.fromkeys(range(len(inputs)), 0)
        try:
            yield (ACCEPTED, self.replica_id)
            while unfinished:
                batch = [await group.events.get()]
                while not group.events.empty():
                    batch.append(group.events.get_nowait())
                for event in batch:
                    if event.finished:
                        unfinished.pop(event.index, None)
                    elif event.index in unfinished:
                        unfinished[event.index] = event.num_committed
                yield batch
        finally:
            del self._unfinished[call]
            if unfinished:
                group.abort()

    def check_health(self) -> None:
        """Ray Serve's health check: raises when the engine thread is not running or has stalled."""
        if not self.async_engine.is_running:
            raise RuntimeError(f"the engine thread is not running ({self.async_engine.error})")
        stalled = self.async_engine.seconds_without_progress()
        if stalled > STALL_TIMEOUT_S:
            raise RuntimeError(f"the engine completed no step for {stalled:.0f} s with requests in flight")

    def pid(self) -> int:
        """This replica's process id (tests kill it to check recovery)."""
        return os.getpid()

    async def load(self) -> tuple[int, list[int]]:
        """``(process id, committed)``: ``committed`` has one entry per request of this replica's streams that
        has not finished yet, the answer positions it committed so far (sorted; 0 while it waits).

        It runs on the event loop of ``generate``, so it sees every stream at one instant: a request listed
        here has not sent its last event, and its caller still waits for its stream to end.
        """
        return os.getpid(), sorted(c for calls in self._unfinished.values() for c in calls.values())

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
            self.async_engine.stop()


class ClusterIngress:
    """The HTTP side's serving layer: an ``OpenAIServing`` whose engine is the replicas (``RemoteEngine``).

    It loads the checkpoint for its tokenizer and configuration only (its own engine never runs), and
    pulls the replicas' engine series from ``board`` into its ``ClusterMetrics``. Used by
    ``CelerisIngress`` (Ray Serve's proxy in front) and by ``run_cluster_server`` (this process's own
    server in front). ``close()`` stops the metrics thread.
    """

    def __init__(self, args: ServeArgs, engine: DeploymentHandle, board: DeploymentHandle | None) -> None:
        from celeris.serve.serving import OpenAIServing

        a = self.args = ServeArgs.model_validate(args)
        llm = LLM(a.model, device="cpu", max_num_seqs=1, dtype=a.dtype, trust_remote_code=a.trust_remote_code,
                  tokenizer=a.tokenizer, chat_template=a.chat_template, speculative_config=a.speculative_config,
                  max_model_len=a.max_model_len)  # the replicas' context window and defaults, for validation
        self.metrics = ClusterMetrics()
        streaming = engine.options(stream=True)
        self.remote = RemoteEngine(lambda inputs, canvas: streaming.generate.remote(inputs, canvas),
                                   a.replica_capacity,
                                   on_failure=lambda code: self.serving.metrics.failed.labels(code=code).inc())
        self.serving = OpenAIServing(llm, async_engine=self.remote, served_model_name=a.served_model_name,
                                     request_timeout=a.request_timeout, metrics=self.metrics)
        self._stop = threading.Event()
        if board is not None:
            threading.Thread(target=self._pull_metrics, args=(board,), daemon=True, name="celeris-metrics").start()

    def limits(self, max_connections: int = 1024) -> ServerLimits:
        """The server limits of ``args`` (body size and deadline, drain time-out)."""
        return ServerLimits(body_timeout_s=self.args.body_timeout_s, max_body_bytes=self.args.max_body_bytes,
                            drain_timeout_s=self.args.drain_timeout_s, max_connections=max_connections)

    def _pull_metrics(self, board: DeploymentHandle) -> None:
        while not self._stop.wait(METRICS_PUSH_S / 2):
            try:
                self.metrics.replicas = board.snapshot.remote().result(timeout_s=10)
            except Exception as exc:
                logger.debug("metrics pull failed: %s", exc)

    def close(self) -> None:
        self._stop.set()


@serve.deployment(name="CelerisIngress", ray_actor_options={"num_cpus": 0})
@serve.ingress()
class CelerisIngress:
    """``ClusterIngress`` as a Serve deployment behind Ray Serve's proxy (``serve run``, ``serve deploy``).

    Ray Serve's CLI owns the signals there; ``drain`` applies the single server's rules from a script.
    """

    def __init__(self, engine: DeploymentHandle, board: DeploymentHandle | None, args: dict) -> None:
        self.ingress = ClusterIngress(ServeArgs.model_validate(args), engine, board)
        self.serving = self.ingress.serving
        self.remote = self.ingress.remote
        self.serving.start()

    def __serve_build_asgi_app__(self):
        from celeris.serve.app import create_app

        return create_app(self.serving, api_key=self.ingress.args.api_key, manage_engine=False,
                          limits=self.ingress.limits())

    def begin_drain(self) -> None:
        """Take no new requests (503 + Retry-After, /health 503); those in flight go on."""
        self.serving.begin_drain()

    def cut_off(self) -> None:
        """End every request in flight with 503 ``server_shutting_down`` (a stream: error event + [DONE])."""
        self.serving.cut_off()

    def num_in_flight(self) -> int:
        return self.remote.num_in_flight

    def __del__(self) -> None:
        ingress = getattr(self, "ingress", None)
        if ingress is not None:
            ingress.close()


# -- building and running --------------------------------------------------------------------------


def build_engine_app(args: ServeArgs | dict) -> serve.Application:
    """The engine replicas and the metrics board, without an HTTP ingress (``run_cluster_server``'s)."""
    args = args if isinstance(args, ServeArgs) else ServeArgs.model_validate(args)
    return CelerisEngine.options(**args.deployment_options()).bind(args.model_dump(), CelerisMetricsBoard.bind())


def build_app(args: ServeArgs | dict) -> serve.Application:
    """The Serve application for ``args`` (a ``ServeArgs`` or its dict), Ray Serve's proxy in front."""
    args = args if isinstance(args, ServeArgs) else ServeArgs.model_validate(args)
    config = args.model_dump()
    board = CelerisMetricsBoard.bind()
    engine = CelerisEngine.options(**args.deployment_options()).bind(config, board)
    ingress_capacity = 4 * args.replica_capacity * (args.max_replicas or args.num_replicas)
    return CelerisIngress.options(max_ongoing_requests=ingress_capacity,
                                  graceful_shutdown_timeout_s=args.drain_timeout_s).bind(engine, board, config)


def app(args: ServeArgs) -> serve.Application:
    """The application builder for ``serve run celeris.serve.ray:app key=value ...`` and Serve config files."""
    return build_app(args)


def init_ray(address: str | None, args: ServeArgs) -> LocalRaySession | None:
    """Attach to the cluster at ``address``, or start a local instance big enough for the replicas.

    Returns the local instance this call started (``celeris.ray_session``: the caller stops it), or None.
    """
    import ray

    env = {"TOKENIZERS_PARALLELISM": "false"}
    if ray.is_initialized():
        return None
    if address:  # every node needs celeris installed and the checkpoint at the same path
        ray.init(address=address, runtime_env={"env_vars": env}, log_to_driver=False)
        return None
    path = os.environ.get("PYTHONPATH", "")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_ROOT, path) if p)
    most = args.max_replicas or args.num_replicas
    num_cpus = max(os.cpu_count() or 1, math.ceil(most * args.num_cpus_per_replica))
    return LocalRaySession.start(num_cpus=num_cpus, include_dashboard=False, runtime_env={"env_vars": env},
                                 log_to_driver=False, object_store_memory=256 << 20)


def drain(handle: DeploymentHandle, timeout_s: float, grace_s: float = 2.0) -> None:
    """The single server's drain on a ``CelerisIngress`` behind ``handle`` (an application deployed with
    ``serve run`` / ``serve deploy``; call it before ``serve delete``): no new requests, those in flight
    finish within ``timeout_s``, then the rest are cut."""
    handle.begin_drain.remote().result()
    deadline = time.monotonic() + timeout_s
    while handle.num_in_flight.remote().result() > 0:
        if time.monotonic() >= deadline:
            logger.warning("drain period over: cutting the requests in flight")
            handle.cut_off.remote().result()
            end = time.monotonic() + grace_s
            while handle.num_in_flight.remote().result() > 0 and time.monotonic() < end:
                time.sleep(0.1)
            return
        time.sleep(0.2)


def run_cluster_server(args: ServeArgs, host: str = "127.0.0.1", port: int = 8000, ray_address: str | None = None,
                       log_level: str = "info", max_connections: int = 1024) -> int:
    """``celeris serve --num-replicas N [--ray-address ADDR]``: the engine replicas on Ray Serve, behind this
    process's own server (``celeris.serve.server.CelerisServer``), until SIGTERM/SIGINT.

    The port is this process's, so the drain is the single server's, request for request: on the first
    SIGTERM/SIGINT new requests get 503 ``server_shutting_down`` with ``Retry-After`` (``/health`` 503),
    requests in flight (headers received) finish within ``drain_timeout_s``, the rest are then cut (a
    stream: error event + ``data: [DONE]``), and the server closes its port. Only then is the application
    deleted, and a local Ray instance stopped (a SIGTERM during start-up or tear-down stops it too). Ray
    Serve's HTTP proxy is not started. Returns 0; ``Terminated`` (exit 143) on a SIGTERM outside the drain.
    """
    from celeris.serve.app import create_app
    from celeris.serve.server import make_server

    logging.getLogger("ray.serve").setLevel(getattr(logging, log_level.upper(), logging.INFO))
    with sigterm_raises():
        session = init_ray(ray_address, args)
        ingress = None
        try:
            serve.start(proxy_location="Disabled")
            engine = serve.run(build_engine_app(args), name=APP_NAME, route_prefix=None)
            ingress = ClusterIngress(args, engine, serve.get_deployment_handle("CelerisMetricsBoard", APP_NAME))
            limits = ingress.limits(max_connections)
            server = make_server(create_app(ingress.serving, api_key=args.api_key, limits=limits), ingress.serving,
                                 limits, log_level=log_level, host=host, port=port)
            replicas = f"{args.min_replicas}-{args.max_replicas} (autoscaled)" if args.autoscaling else args.num_replicas
            print(f"celeris: serving on http://{host}:{port} with {replicas} engine replica(s) on Ray Serve; "
                  "Ctrl-C or SIGTERM drains and stops", flush=True)
            server.run()  # until the drain is over and the port closed
            if session is None:  # on a cluster of others; a local instance goes as a whole below
                serve.delete(APP_NAME)
        finally:
            if ingress is not None:
                ingress.close()
            if session is not None:
                with contextlib.suppress(Exception):
                    serve.shutdown()
                session.stop()
    return 0
