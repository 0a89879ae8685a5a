"""The OpenAI server on Ray Serve (``celeris.serve.ray``) as ``serve run`` deploys it: the ``CelerisIngress``
deployment behind Ray Serve's proxy, in front of engine replicas on a local Ray instance, driven by the
official ``openai`` client and raw HTTP (``celeris serve --num-replicas``, with Celeris's own server in
front, is tests/serve/test_ray_drain.py). One replica CPU each (this machine
has few cores), the tiny checkpoint of the serve tests."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import threading
import time

import httpx
import openai
import pytest

from celeris.serve.app import BackgroundServer, create_app
from tests.serve.conftest import MODEL_NAME, make_serving

# Ray and Ray Serve (and celeris.serve.ray, which imports them) are imported inside the fixtures and tests, not at
# collection: the fast tier deselects this module but would pay their ~1.5 s import in every xdist worker
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="Ray is not installed")]

PORT = 18431  # Ray Serve's proxy binds this port (a fixed one: the proxy picks it, not the test)
URL = f"http://127.0.0.1:{PORT}"
PROMPTS = ["def fibonacci(n):", "class Stack:", "import os\n"]


def deploy(checkpoint, **overrides) -> None:
    """(Re)deploy the application at / with the test checkpoint; returns when it is ready."""
    from ray import serve

    from celeris.serve.ray import APP_NAME, ServeArgs, build_app

    args = ServeArgs(model=str(checkpoint), served_model_name=MODEL_NAME, **overrides)
    serve.run(build_app(args), name=APP_NAME, route_prefix="/")


@pytest.fixture(scope="module")
def cluster(serve_checkpoint):
    ray = pytest.importorskip("ray")
    serve = pytest.importorskip("ray.serve")
    from celeris.serve.ray import ServeArgs, init_ray

    session = init_ray(None, ServeArgs(num_replicas=2))  # a local instance, recorded (celeris.ray_session)
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": PORT})
    deploy(serve_checkpoint, num_replicas=2, max_num_seqs=2, max_waiting=4, request_timeout=60)
    yield
    serve.shutdown()
    if session is not None:
        session.stop()
    else:
        ray.shutdown()


@pytest.fixture
def client(cluster):
    return openai.OpenAI(base_url=f"{URL}/v1", api_key="unused", max_retries=0, timeout=60)


def sse_events(response: httpx.Response) -> list[str]:
    return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


def engine_status() -> tuple[str, int]:
    from ray import serve

    from celeris.serve.ray import APP_NAME

    deployment = serve.status().applications[APP_NAME].deployments["CelerisEngine"]
    return deployment.status, deployment.replica_states.get("RUNNING", 0)


def test_two_replicas_answer_the_openai_client(client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=16, seed=1, temperature=1.0)
    assert out.choices[0].finish_reason in ("stop", "length") and 0 < out.usage.completion_tokens <= 16
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=16, seed=2)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens > 0
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=16, seed=3,
                                            temperature=1.0, stream=True))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    whole = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=16, seed=3, temperature=1.0)
    assert streamed == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    chat_chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=16, seed=2, stream=True))
    assert chat_chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chat_chunks) == chat.choices[0].message.content


def test_same_seed_same_text_as_the_single_process_server(client, serve_llm):
    requests = [dict(prompt=p, max_tokens=16, seed=s, temperature=1.0) for p in PROMPTS for s in (7, 8)]
    with BackgroundServer(create_app(make_serving(serve_llm))) as single:
        local = openai.OpenAI(base_url=f"{single.url}/v1", api_key="unused", max_retries=0, timeout=60)
        expected = [local.completions.create(model=MODEL_NAME, **r).choices[0].text for r in requests]
    # twice each, concurrently: both replicas answer (the router spreads the load) and every answer matches
    results: dict[int, str] = {}

    def ask(i: int) -> None:
        results[i] = client.completions.create(model=MODEL_NAME, **requests[i % len(requests)]).choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2 * len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [results[i] for i in range(len(threads))] == expected * 2
    assert len({expected[0], expected[1]}) == 2, "seeds 7 and 8 should differ (else the check proves nothing)"


def test_metrics_show_each_replica(client):
    # a burst beyond one replica's max_ongoing_requests (6): the router must use both replicas
    threads = [threading.Thread(target=client.completions.create,
                                kwargs=dict(model=MODEL_NAME, prompt=PROMPTS[i % 3], max_tokens=48)) for i in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    deadline = time.monotonic() + 20
    while True:  # replicas post their series every couple of seconds
        text = httpx.get(f"{URL}/metrics", timeout=10).text
        admitted = {line.split('replica="', 1)[1].split('"', 1)[0]: float(line.rsplit(" ", 1)[1])
                    for line in text.splitlines() if line.startswith("celeris_replica_generations_total{")}
        if (len(admitted) == 2 and all(admitted.values())) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(admitted) == 2 and all(v > 0 for v in admitted.values()), admitted  # both replicas answered
    running = {line.split('replica="', 1)[1].split('"', 1)[0] for line in text.splitlines()
               if line.startswith("celeris_num_requests_running{")}
    assert running == set(admitted)
    cached = {line.split('replica="', 1)[1].split('"', 1)[0] for line in text.splitlines()
              if line.startswith("celeris_prefix_cache_queries_total{")}
    assert cached == set(admitted)  # every replica's prefix-cache counters, as a single server's
    assert 'celeris_http_requests_total{path="/v1/completions",status="200"}' in text


def test_bad_request_is_400(cluster):
    r = httpx.post(f"{URL}/v1/completions", json={"prompt": "x", "max_tokens": 0}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = httpx.post(f"{URL}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(f"{URL}/v1/completions", json={"model": "other", "prompt": "x"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def is_openai_error(status: int, body: str) -> bool:
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return status >= 400 and isinstance(error.get("message"), str) and bool(error["message"])


ANSWER = 96  # answer positions of the load's requests (ignore_eos: all of them, 2 per step at this checkpoint)
HALF_ANSWER = ANSWER // 2


def one_request(i: int, outcomes: list) -> None:
    """A streamed or plain completion; appends (kind, ok, detail) and never raises."""
    body = {"model": MODEL_NAME, "prompt": PROMPTS[i % 3], "max_tokens": ANSWER, "ignore_eos": True, "seed": i,
            "temperature": 1.0, "stream": i % 2 == 0}
    try:
        with httpx.stream("POST", f"{URL}/v1/completions", json=body, timeout=90) as r:
            if not body["stream"] or r.status_code != 200:
                text = r.read().decode()
                ok = (r.status_code == 200 and json.loads(text)["choices"]) or is_openai_error(r.status_code, text)
                outcomes.append(("plain" if r.status_code == 200 else f"error {r.status_code}", bool(ok), text[:200]))
                return
            events = sse_events(r)
        assert events[-1] == "[DONE]", events[-3:]
        payloads = [json.loads(e) for e in events[:-1]]
        failed = [p for p in payloads if "error" in p]
        ok = all(isinstance(p["error"]["message"], str) for p in failed) and (failed or payloads[-1]["choices"])
        outcomes.append(("stream error" if failed else "stream", bool(ok), str(failed)[:200]))
    except Exception as exc:  # a hang (time-out) or a broken response is a failure of the server
        outcomes.append(("exception", False, f"{type(exc).__name__}: {exc}"))


def test_killing_a_replica_under_load(cluster, client):
    from ray import serve

    from celeris.serve.ray import APP_NAME

    handle = serve.get_deployment_handle("CelerisEngine", APP_NAME)
    pids = set()
    for _ in range(20):
        pids.add(handle.pid.remote().result(timeout_s=30))
        if len(pids) == 2:
            break
    assert len(pids) == 2
    outcomes: list = []
    threads = [threading.Thread(target=lambda k=k: [one_request(k * 10 + j, outcomes) for j in range(5)])
               for k in range(6)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while len(outcomes) < 4 and time.monotonic() < deadline:  # kill once the load is steady: both replicas busy
        time.sleep(0.05)
    victim = None
    while victim is None:  # ask replicas (the router picks one) until one has a request early in its answer
        assert len(outcomes) < 30 and time.monotonic() < deadline, "no replica was seen with a request in flight"
        pid, committed = handle.load.remote().result(timeout_s=30)
        assert pid in pids, (pid, pids)
        if committed and committed[0] <= HALF_ANSWER:
            victim = pid
        else:
            time.sleep(0.02)
    # the victim's reply (taken on the loop of its streams) listed an unfinished request whose stream the ingress
    # reads, with at least HALF_ANSWER positions still to commit: 24 more engine steps (ignore_eos, 2 positions
    # per step), against one reply's trip before the kill lands. So the kill cuts a request in flight, and the
    # ingress must count a replica failure
    os.kill(victim, signal.SIGKILL)
    for t in threads:
        t.join(150)
    assert not any(t.is_alive() for t in threads), "a request hung"
    assert len(outcomes) == 30
    assert all(ok for _, ok, _ in outcomes), [o for o in outcomes if not o[1]]
    metrics = httpx.get(f"{URL}/metrics", timeout=10).text
    failures = [line for line in metrics.splitlines() if line.startswith('celeris_failed_requests_total{code="replica_')]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in failures) >= 1, "the kill hit no request in flight"
    deadline = time.monotonic() + 120
    while engine_status() != ("HEALTHY", 2):
        assert time.monotonic() < deadline, f"the engine deployment did not recover: {engine_status()}"
        time.sleep(1)
    new_pids = {handle.pid.remote().result(timeout_s=30) for _ in range(10)}
    assert victim not in new_pids
    for i in range(4):
        out = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[i % 3], max_tokens=8)
        assert out.choices[0].finish_reason in ("stop", "length")
    print("killed", victim, "with", committed, "committed; outcomes:", sorted(kind for kind, _, _ in outcomes),
          [d for k, _, d in outcomes if "error" in k])


def test_drain_finishes_requests_in_flight_and_refuses_new_ones(cluster):
    from ray import serve

    from celeris.serve.ray import APP_NAME, drain

    outcomes: list = []
    ingress = serve.get_app_handle(APP_NAME)
    stream = threading.Thread(target=one_request, args=(0, outcomes))  # even: streamed
    stream.start()
    deadline = time.monotonic() + 30
    while ingress.num_in_flight.remote().result(timeout_s=30) == 0:  # the ingress has taken the stream in
        assert stream.is_alive() and time.monotonic() < deadline, f"the stream never got in flight: {outcomes}"
        time.sleep(0.01)
    started = time.monotonic()
    drain(ingress, timeout_s=30)
    stream.join(60)
    assert outcomes and outcomes[0][:2] == ("stream", True), outcomes
    assert time.monotonic() - started < 30
    r = httpx.post(f"{URL}/v1/completions", json={"prompt": "x", "max_tokens": 4}, timeout=30)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "server_shutting_down"
    assert httpx.get(f"{URL}/health", timeout=30).status_code == 503


def test_backpressure_is_429_with_retry_after(cluster, serve_checkpoint):
    # one replica holding 2 requests, a router queue of 1: a burst of 12 overflows it
    deploy(serve_checkpoint, num_replicas=1, max_num_seqs=1, max_waiting=1, max_queued_requests=1)
    responses: list[httpx.Response] = []

    def ask(i: int) -> None:
        body = {"model": MODEL_NAME, "prompt": PROMPTS[i % 3], "max_tokens": 64, "seed": i}
        responses.append(httpx.post(f"{URL}/v1/completions", json=body, timeout=90))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    statuses = sorted(r.status_code for r in responses)
    assert len(statuses) == 12 and set(statuses) <= {200, 429}, statuses
    assert 200 in statuses and 429 in statuses, statuses
    for r in responses:
        if r.status_code == 429:
            assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "queue_full"
