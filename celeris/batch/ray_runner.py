"""The same batch job on Ray: a pool of actors, each holding one engine, fed by Ray Data.

The driver does everything that touches the output file, exactly as the local runner does
(``celeris.batch.jobs``): validate the input, repair the output, remove failed records for
``retry_failed``, record malformed lines, then append + fsync each record as it arrives from the
pool. Only the requests travel through Ray:

1. the items still to run are streamed into a spool file next to the output (the input is never
   loaded whole) and read back with ``ray.data.read_text`` (``local://`` on a cluster, so the
   read runs on the driver's node);
2. ``map_batches(ServingActor, compute=ActorPoolStrategy(size=num_workers))``: each actor loads
   the checkpoint once, runs one ``OpenAIServing`` and sends every row through ``respond`` (the
   HTTP server's code path), ``max_num_seqs`` rows per batch and two batches in flight per actor so
   its engine stays full;
3. the driver iterates the mapped dataset (``iter_rows``) and writes each record as it comes.

A crash anywhere (driver, actor, node) loses at most the records not yet written; the next start
runs exactly those. Every actor asks for ``num_cpus=1`` and runs torch on one thread.

The local Ray instance a job starts is recorded (``celeris.ray_session``) and stopped when the job ends,
on SIGTERM too (exit 143, records so far kept); what a SIGKILLed job left running (the raylet's agents
outlive it) is reaped by the next job's start.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import celeris
from celeris.batch.jobs import (
    BatchError,
    BatchItem,
    EngineUnavailableError,
    OpenJob,
    error_record,
    iter_todo,
    open_job,
    run_item,
)
from celeris.config import SERVER_MAX_WAITING, EngineConfig, engine_fields

if TYPE_CHECKING:
    from celeris.ray_session import LocalRaySession

PACKAGE_ROOT = str(Path(celeris.__file__).resolve().parent.parent)


class ServingActor:
    """A Ray Data callable class: one engine per actor; rows of item JSON in, rows of record JSON out.

    Its event loop lives on a thread of its own, so the two batches Ray Data may run in the actor
    at once (``max_concurrent_calls_per_actor=2``) share one engine.
    """

    def __init__(self, model: str | None, request_timeout: float, served_model_name: str | None,
                 **llm_kwargs: Any) -> None:
        """``llm_kwargs``: ``LLM``'s load options and ``EngineConfig`` fields (``max_num_seqs`` among them);
        the queue holds ``max(SERVER_MAX_WAITING, 4 x max_num_seqs)`` unless ``max_waiting`` is given."""
        import torch

        from celeris.serve.serving import OpenAIServing

        torch.set_num_threads(1)
        max_num_seqs = llm_kwargs.get("max_num_seqs", engine_fields()["max_num_seqs"].default)
        llm_kwargs.setdefault("max_waiting", max(SERVER_MAX_WAITING, 4 * max_num_seqs))
        self.serving = OpenAIServing.from_model(model, request_timeout=request_timeout,
                                                served_model_name=served_model_name, **llm_kwargs)
        self.serving.start()
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="batch-actor-loop", daemon=True).start()

    def __call__(self, batch: dict) -> dict:
        items = [BatchItem.from_json(text) for text in batch["text"]]

        async def run_all() -> list[dict]:
            return await asyncio.gather(*(run_item(self.serving, item) for item in items))

        records = asyncio.run_coroutine_threadsafe(run_all(), self.loop).result()
        return {"record": [json.dumps(r, ensure_ascii=False) for r in records]}

    def __del__(self) -> None:
        serving = getattr(self, "serving", None)
        if serving is not None:
            serving.stop()


def init_ray(address: str | None, num_cpus: int) -> LocalRaySession | None:
    """Attach to the cluster at ``address``, or start a small local instance (no dashboard).

    Returns the local instance this call started (``celeris.ray_session``: the caller stops it), or None.
    Raises ``EngineUnavailableError`` when the local instance could not start.
    """
    import ray
    import ray.data

    from celeris.ray_session import LocalRaySession, RayStartError

    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    session = None
    if ray.is_initialized():  # the caller set Ray up already
        pass
    elif address:  # the cluster's nodes must have celeris installed and the checkpoint at the same path
        ray.init(address=address, runtime_env={"env_vars": env}, log_to_driver=False)
    else:  # a local instance: its workers import celeris from where this process does
        path = os.environ.get("PYTHONPATH", "")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_ROOT, path) if p)
        try:
            session = LocalRaySession.start(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
                                            runtime_env={"env_vars": env}, object_store_memory=256 << 20)
        except RayStartError as exc:
            raise EngineUnavailableError(str(exc)) from exc
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False  # the job has its own bar; Ray's would only repeat it
    ctx.print_on_execution_start = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    return session


def run_batch_ray(
    input_path: str | Path,
    output_path: str | Path,
    *,
    model: str | None,
    retry_failed: bool = False,
    rerun_changed: bool = False,
    num_workers: int = 2,
    max_num_seqs: int = 8,
    request_timeout: float = 600.0,
    served_model_name: str | None = None,
    ray_address: str | None = None,
    ray_num_cpus: int = 2,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
    **llm_kwargs: Any,
) -> dict:
    """Run (or resume) a batch job on Ray; same files, records and summary as ``jobs.run_batch``.

    ``llm_kwargs``: what each actor's ``LLM`` takes besides ``max_num_seqs`` (its load options, with
    ``tokenizer`` / ``chat_template`` as absolute paths, and any ``EngineConfig`` field: ``device``, ``dtype``,
    ``max_model_len``, ``quantization``, ...), checked here by ``EngineConfig.from_kwargs`` before Ray starts.

    First reaps the local Ray instances of earlier jobs that were killed (``celeris.ray_session``); the
    instance this job starts is stopped when it ends, also on SIGTERM (then ``Terminated``, exit 143).

    Raises:
        BatchError: Ray is not installed, a bad setting, or a file error (exit 2).
        EngineUnavailableError: an actor died or could not start (exit 1: rerun to finish).
        Terminated: SIGTERM arrived (the records written so far stay; a rerun runs the rest).
    """
    try:
        import ray.exceptions

        from celeris.ray_session import reap_orphaned_sessions, sigterm_raises
    except ImportError:
        raise BatchError("--backend ray needs Ray: pip install 'celeris[ray]' (ray[data])") from None
    check_settings(num_workers, max_num_seqs, llm_kwargs)
    reap_orphaned_sessions()  # what a killed job (SIGKILL) left running
    real = Path(os.path.realpath(output_path))
    spool = real.with_name(f".{real.name}.ray-spool.jsonl")

    def on_sigterm() -> None:
        if log is not None:
            log("SIGTERM: stopping the job and its Ray instance; rerun the same command to finish it")

    with sigterm_raises(on_sigterm), open_job(input_path, output_path, retry_failed=retry_failed, log=log,
                                              rerun_changed=rerun_changed, progress=progress, desc="batch[ray]") as job:
        written: set[str] = set()  # ids written by this run: a row Ray hands over twice is written once
        session = None
        try:
            def sink(record: dict) -> None:
                cid = record.get("custom_id")
                if cid is not None:
                    if cid in written:
                        return
                    written.add(cid)
                job.record(record)

            if spool_todo(input_path, job, spool, sink):
                session = init_ray(ray_address, ray_num_cpus)
                actor_kwargs = {"model": str(Path(model).resolve()) if model else None, "max_num_seqs": max_num_seqs,
                                "request_timeout": request_timeout, "served_model_name": served_model_name,
                                **llm_kwargs}
                try:
                    for row in map_on_ray(spool, actor_kwargs, num_workers, on_cluster=bool(ray_address)):
                        sink(json.loads(row["record"]))
                except ray.exceptions.RayError as exc:  # an actor died or failed to start
                    raise EngineUnavailableError(f"the Ray job failed: {first_line(exc)}") from exc
        finally:
            spool.unlink(missing_ok=True)
            if session is not None:
                session.stop()
    return job.summary()


def check_settings(num_workers: int, max_num_seqs: int, llm_kwargs: dict[str, Any]) -> None:
    """Refuse a bad worker count or engine setting (``EngineConfig.from_kwargs``) before Ray starts.

    Raises:
        BatchError: the line naming the setting.
    """
    if num_workers < 1:
        raise BatchError(f"--num-workers must be >= 1, got {num_workers}")
    engine = {k: v for k, v in llm_kwargs.items() if k in engine_fields()}
    try:
        EngineConfig.from_kwargs(max_num_seqs=max_num_seqs, **engine)
    except ValueError as exc:
        raise BatchError(str(exc)) from None


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (Ray's carry a traceback), or its type's name."""
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def spool_todo(input_path: str | Path, job: OpenJob, spool: Path, sink: Callable[[dict], None]) -> int:
    """Write the job's runnable to-do items to ``spool`` (JSON Lines, Ray Data's input) and hand the records of
    unrunnable ones (bad JSON, a missing id, ...) to ``sink``; returns how many items were spooled.

    Raises:
        BatchError: the spool file cannot be written.
    """
    num_requests = 0
    try:
        with open(spool, "w", encoding="utf-8") as fh:
            for item in iter_todo(input_path, job.plan.done, job.scan):
                if item.error_code is not None:
                    sink(error_record(item))
                else:
                    fh.write(item.to_json() + "\n")
                    num_requests += 1
    except OSError as exc:
        raise BatchError(f"cannot write the spool file '{spool}': {exc.strerror}") from None
    return num_requests


def map_on_ray(spool: Path, actor_kwargs: dict, num_workers: int, on_cluster: bool) -> Iterator[dict]:
    """The rows ``{"record": JSON}`` of the spool's items, run by ``num_workers`` ServingActors (Ray Data)."""
    import ray.data

    # On a cluster, "local://" reads the spool on this (the driver's) node.
    spool_uri = f"local://{spool.resolve()}" if on_cluster else str(spool.resolve())
    ds = ray.data.read_text(spool_uri, num_cpus=0)
    ds = ds.map_batches(
        ServingActor,
        fn_constructor_kwargs=actor_kwargs,
        batch_size=actor_kwargs["max_num_seqs"],
        batch_format="numpy",
        num_cpus=1,
        compute=ray.data.ActorPoolStrategy(size=num_workers, max_tasks_in_flight_per_actor=2,
                                           max_concurrent_calls_per_actor=2, enable_true_multi_threading=True),
    )
    return ds.iter_rows()
