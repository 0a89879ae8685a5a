"""`celeris serve` in a child process under attack: SIGTERM while streams run, file descriptors running
out, a large upload. Slow (a model load per test), still run by CI."""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.serve.conftest import wait_for_health
from tests.serve.test_cli_serve import REPO_ROOT, free_port

pytestmark = pytest.mark.slow


class ServeProcess:
    """``celeris serve`` on a free loopback port; ``log`` is its combined output once stopped."""

    def __init__(self, checkpoint: Path, *args: str, nofile: int | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)}
        env.pop("CELERIS_API_KEY", None)
        cmd = [sys.executable, "-m", "celeris.cli", "serve", "--model", str(checkpoint), "--port", str(self.port),
               "--log-level", "info", *args]

        def limit_fds() -> None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

        self.proc = subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, preexec_fn=limit_fds if nofile else None)
        self.log = ""
        wait_for_health(self.proc, self.url)

    def rss_mb(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024

    def stop(self, sig: int = signal.SIGINT, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.log = self.proc.communicate(timeout=timeout)[0]
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.log = self.proc.communicate()[0]
        return self.proc.returncode


LONG = {"prompt": "def f(x):", "max_tokens": 64, "steps": 64, "block_length": 64, "stream": True}


def test_sigterm_drains_streams_with_an_error_event_and_done(serve_checkpoint):
    server = ServeProcess(serve_checkpoint, "--max-num-seqs", "2", "--max-waiting", "40", "--drain-timeout", "0.5")
    try:
        async def stream(client: httpx.AsyncClient) -> str:
            async with client.stream("POST", f"{server.url}/v1/completions", json=LONG) as resp:
                return "".join([chunk async for chunk in resp.aiter_text()])

        async def main() -> tuple[list, list[int]]:
            async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=64)) as client:
                tasks = [asyncio.create_task(stream(client)) for _ in range(32)]
                await asyncio.sleep(0.5)
                server.proc.send_signal(signal.SIGTERM)
                health = []
                for _ in range(3):  # while it drains: 503 (or already gone when everything finished)
                    try:
                        health.append((await client.get(f"{server.url}/health")).status_code)
                    except httpx.TransportError:
                        break
                return await asyncio.gather(*tasks, return_exceptions=True), health

        bodies, health = asyncio.run(main())
        assert set(health) <= {503}, health
        assert all(isinstance(b, str) for b in bodies), bodies
        assert all(b.rstrip().endswith("data: [DONE]") for b in bodies)  # none truncated
        cut = [b for b in bodies if "server_shutting_down" in b]
        assert cut, "no stream was still running at the end of the drain period"
        assert server.proc.wait(30) == 0
    finally:
        server.stop()
    assert "Traceback" not in server.log, server.log[-3000:]


def test_running_out_of_file_descriptors_keeps_health_answering(serve_checkpoint):
    """With RLIMIT_NOFILE 256, 400 idle sockets: the server stays under its fd limit (closing the oldest
    idle sockets), /health answers, and the log stays small."""
    server = ServeProcess(serve_checkpoint, nofile=256)
    held: list[socket.socket] = []
    try:
        for _ in range(400):
            try:
                held.append(socket.create_connection(("127.0.0.1", server.port), timeout=2))
            except OSError:
                break
        time.sleep(0.5)
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
        open_fds = len(os.listdir(f"/proc/{server.proc.pid}/fd"))
        assert open_fds < 256, open_fds
    finally:
        for s in held:
            s.close()
        server.stop()
    assert "Traceback" not in server.log
    assert "Too many open files" not in server.log  # it never ran out: idle sockets were closed in time
    assert len(server.log) < 20_000, len(server.log)


def test_a_large_upload_is_refused_without_growing_memory(serve_checkpoint):
    server = ServeProcess(serve_checkpoint, "--log-level", "warning")
    try:
        before = server.rss_mb()
        chunk = b"x" * (1 << 20)

        def body():
            for _ in range(64):  # 64 MiB, chunked (no Content-Length)
                yield chunk

        try:
            resp = httpx.post(f"{server.url}/v1/completions", content=body(),
                              headers={"content-type": "application/json"}, timeout=30)
            assert resp.status_code == 413
        except httpx.TransportError:
            pass  # the server answered 413 and closed while the client was still sending
        sized = httpx.post(f"{server.url}/v1/completions", content=b"x" * (64 << 20),
                           headers={"content-type": "application/json"}, timeout=30)
        assert sized.status_code == 413
        grown = server.rss_mb() - before
        assert grown < 40, f"resident memory grew by {grown:.0f} MB"
    finally:
        server.stop()
