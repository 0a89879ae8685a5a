"""`celeris serve --num-replicas 2` in a child process, SIGTERM under load: the drain is the single
server's (every request in flight finishes with 200, new ones get 503 JSON with Retry-After, /health
503, never a 404 or a body that is not JSON), the process exits within the drain time-out and leaves
no process of its Ray instance behind. Slow: a local Ray instance with two engine replicas."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.serve.conftest import MODEL_NAME
from tests.serve.test_cli_serve import REPO_ROOT, free_port

# Ray Serve is imported by the test's child, not at collection (the fast tier deselects this module)
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="Ray is not installed")]

DRAIN_TIMEOUT_S = 90
PROMPTS = ["def fibonacci(n):", "class Stack:", "import os\n", "# user: hi"]


class Client(threading.Thread):
    """One client: a completion of 96 tokens, one per step. Client 0 streams and sets ``started`` at its
    first event; clients 4-7 send their headers and a first piece of the body, set ``started``, and send
    the rest once ``release`` is set (so they are in flight at SIGTERM however fast the engines are)."""

    def __init__(self, url: str, i: int, release: threading.Event) -> None:
        super().__init__(daemon=True)
        self.url, self.i, self.release = url, i, release
        self.started = threading.Event()
        self.outcome: tuple | None = None  # (status, body, time.monotonic() at the end)

    def body(self):
        payload = json.dumps({"model": MODEL_NAME, "prompt": PROMPTS[self.i % 4], "max_tokens": 96, "steps": 96,
                              "block_length": 96, "seed": self.i, "temperature": 1.0, "stream": self.i == 0}).encode()
        if self.i < 4:
            yield payload
            return
        self.started.set()
        yield payload[:10]
        self.release.wait(120)
        yield payload[10:]

    def run(self) -> None:
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", content=self.body(),
                              headers={"content-type": "application/json"}, timeout=DRAIN_TIMEOUT_S + 60) as r:
                text = ""
                for line in r.iter_lines():
                    text += line + "\n"
                    if line.startswith("data: "):
                        self.started.set()
                self.outcome = (r.status_code, text, time.monotonic())
        except httpx.HTTPError as exc:
            self.outcome = (None, f"{type(exc).__name__}: {exc}", time.monotonic())
        finally:
            self.started.set()


def is_error_json(response: httpx.Response, status: int, code: str) -> bool:
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return response.status_code == status and error.get("code") == code and bool(error.get("message"))


def probe_while_draining(url: str, proc: subprocess.Popen) -> list[httpx.Response]:
    """New requests and /health, over and over, until the port closes."""
    seen = []
    while proc.poll() is None:
        try:
            seen.append(httpx.get(f"{url}/health", timeout=10))
            seen.append(httpx.post(f"{url}/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 4},
                                   timeout=10))
        except httpx.TransportError:  # the port is closed: the drain is over
            break
        time.sleep(0.1)
    return seen


def test_sigterm_under_load_drains_like_the_single_server(tmp_path, serve_checkpoint):
    from celeris.ray_session import SessionRecord, session_processes

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    sessions = tmp_path / "sessions"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "CELERIS_RAY_SESSIONS": str(sessions),
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    env.pop("CELERIS_API_KEY", None)
    log = open(tmp_path / "serve.log", "w+")  # noqa: SIM115 - read after the process ends
    cmd = [sys.executable, "-m", "celeris.cli", "serve", "--model", str(serve_checkpoint), "--port", str(port),
           "--served-model-name", MODEL_NAME, "--num-replicas", "2", "--max-num-seqs", "1", "--max-waiting", "8",
           "--drain-timeout", str(DRAIN_TIMEOUT_S), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:  # the port opens once both replicas run
            assert proc.poll() is None, open(log.name).read()[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "celeris serve --num-replicas 2 did not come up"
            time.sleep(0.5)
        record = SessionRecord.read(next(sessions.glob("*.json")))

        release = threading.Event()
        clients = [Client(url, i, release) for i in range(8)]
        for c in clients:
            c.start()
        for c in (clients[0], *clients[4:]):  # the stream runs; the held requests' headers are sent
            assert c.started.wait(120), f"client {c.i} did not start"
        time.sleep(2.0)  # the server has read those headers: the held requests are in flight
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        release.set()
        probes = probe_while_draining(url, proc)
        for c in clients:
            c.join(DRAIN_TIMEOUT_S + 60)
        code = proc.wait(DRAIN_TIMEOUT_S + 60)
        exited = time.monotonic()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        log.seek(0)
        output = log.read()
        log.close()
        print("server log (tail):", output[-5000:])  # pytest shows it when the test fails

    outcomes = {c.i: c.outcome for c in clients}
    print("outcomes:", {i: o and (o[0], o[1][:200]) for i, o in outcomes.items()})
    assert all(o is not None for o in outcomes.values()), "a client hung"
    for i, (status, text, _) in outcomes.items():
        assert status == 200, (i, status, text[:300])
        if i == 0:  # the stream: every event is a chunk, none an error, and it ends with [DONE]
            events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and all("error" not in json.loads(e) for e in events[:-1]), events[-3:]
            assert json.loads(events[-2])["choices"][0]["finish_reason"] in ("stop", "length")
        else:
            assert json.loads(text)["choices"][0]["finish_reason"] in ("stop", "length")
    finished_late = [i for i, (_, _, end) in outcomes.items() if end > signalled]
    assert set(finished_late) >= {4, 5, 6, 7}, finished_late  # the held ones ran after SIGTERM

    assert probes and all(r.status_code != 404 for r in probes), [(r.status_code, r.text[:100]) for r in probes]
    for r in probes:  # before the signal is handled a probe may still be served; after it, only 503 JSON errors
        assert r.status_code == 200 or is_error_json(r, 503, "server_shutting_down"), (r.status_code, r.text[:200])
    refused = [r for r in probes if r.request.url.path == "/v1/completions" and r.status_code == 503]
    assert refused and all(r.headers["retry-after"] == "1" for r in refused)
    assert any(r.request.url.path == "/health" and r.status_code == 503 for r in probes)

    assert code == 0, output[-3000:]
    assert exited - signalled < DRAIN_TIMEOUT_S, f"exited {exited - signalled:.0f} s after SIGTERM"
    assert "Traceback" not in output, output[-3000:]
    assert session_processes(record) == [] and not list(sessions.glob("*.json"))  # its Ray instance is gone
    print(f"{len(finished_late)} request(s) finished after SIGTERM; exit {exited - signalled:.1f} s after it; "
          f"{len(refused)} new request(s) refused")
