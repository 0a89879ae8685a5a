"""`celeris serve` end to end: a child process serving the tiny checkpoint on a free loopback port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import stop_server
from tests.serve.conftest import wait_for_health

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_celeris_serve_subcommand(serve_checkpoint):
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    cmd = [sys.executable, "-m", "celeris.cli", "serve", "--model", str(serve_checkpoint), "--port", str(port),
           "--max-num-seqs", "2", "--max-waiting", "2", "--served-model-name", "cli-model", "--api-key", "k1",
           "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(proc, url)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="k1", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["cli-model"]
        out = client.completions.create(model="cli-model", prompt="def f(x):", max_tokens=4)
        assert out.usage.completion_tokens <= 4
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "x"}).status_code == 401
    finally:
        returncode = stop_server(proc)
    assert returncode == 0


def test_celeris_serve_rejects_bad_options(capsys):
    from celeris.cli import main

    for args, message in ((["--model", "/no/such/folder"], "does not exist"),
                          (["--max-waiting", "0"], "--max-waiting must be >= 1"),
                          (["--request-timeout", "0"], "--request-timeout must be a finite number > 0"),
                          (["--request-timeout", "nan"], "--request-timeout must be a finite number > 0"),
                          (["--request-timeout", "inf"], "--request-timeout must be a finite number > 0"),
                          (["--drain-timeout", "nan"], "--drain-timeout must be a finite number > 0"),
                          (["--max-connections", "0"], "max_connections must be >= 1"),
                          (["--api-key", ""], "--api-key (or $CELERIS_API_KEY) empty"),
                          (["--api-key", "  "], "--api-key (or $CELERIS_API_KEY) empty"),
                          (["--api-key", " k1 "], "leading or trailing whitespace"),
                          (["--port", "70000"], "--port must be in")):
        assert main(["serve", *args]) == 2, args
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_an_empty_api_key_in_the_environment_is_refused(capsys, monkeypatch):
    from celeris.cli import main

    monkeypatch.setenv("CELERIS_API_KEY", "")
    assert main(["serve"]) == 2
    assert "$CELERIS_API_KEY) empty" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "message"), [
    (["--num-replicas", "0"], "--num-replicas: Input should be greater than or equal to 1"),
    (["--min-replicas", "3", "--max-replicas", "2"], "min_replicas (3) must not exceed max_replicas (2)"),
    (["--num-replicas", "2", "--num-cpus-per-replica", "0"], "--num-cpus-per-replica"),
    (["--num-replicas", "2", "--max-connections", "0"], "max_connections must be >= 1"),
])
def test_ray_serve_flags_are_checked_before_ray_starts(flags, message, capsys):
    pytest.importorskip("ray.serve")
    from celeris.cli import main

    assert main(["serve", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("celeris: error:") and message in err and len(err.splitlines()) == 1


@pytest.mark.slow  # a child Python
def test_serve_without_ray_flags_never_imports_ray():
    code = ("import sys; import celeris.serve.app as app; app.run_server = lambda *a, **k: 0; "
            "from celeris.cli import main; rc = main(['serve']); print(rc, 'ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert out.stdout.split() == ["0", "False"], out.stderr[-2000:]


def test_no_enable_prefix_caching_reaches_the_engine_config(monkeypatch):
    """vLLM's flag: prefix caching is on unless ``--no-enable-prefix-caching`` turns it off."""
    import celeris.serve.app as app
    from celeris.cli import main

    seen = []
    monkeypatch.setattr(app, "run_server", lambda *a, **k: seen.append(k["enable_prefix_caching"]) or 0)
    assert main(["serve"]) == 0 and main(["serve", "--no-enable-prefix-caching"]) == 0
    assert seen == [True, False]


def test_logprobs_mode_reaches_the_engine_and_bad_ones_are_refused(capsys, monkeypatch):
    import celeris.serve.app as app
    from celeris.cli import main

    seen = {}
    monkeypatch.setattr(app, "run_server", lambda model, **kwargs: seen.update(kwargs) or 0)
    assert main(["serve", "--logprobs-mode", "processed_logprobs"]) == 0
    assert seen["logprobs_mode"] == "processed_logprobs"
    assert main(["serve", "--logprobs-mode", "sampled"]) == 2
    err = capsys.readouterr().err
    assert "--logprobs-mode" in err and len(err.strip().splitlines()) == 1
