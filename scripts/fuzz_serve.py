"""Property-based run of the server's own OpenAPI schema (schemathesis): every generated request must get
an answer that is not a 5xx.

    pip install -e ".[fuzz]"
    python scripts/fuzz_serve.py [CHECKPOINT] [--max-examples 40]

Serves CHECKPOINT (default: the embedded model) on a free loopback port in this process, on CPU, and
runs ``st run .../openapi.json --checks not_a_server_error`` against it. A 504 counts as a failure too:
it means a generated setting kept the engine from finishing in time.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys

from celeris.serve.app import BackgroundServer, create_app
from celeris.serve.serving import OpenAIServing


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", nargs="?")
    parser.add_argument("--max-examples", type=int, default=40, help="generated requests per operation and phase")
    parser.add_argument("--request-timeout", type=float, default=30.0)
    args = parser.parse_args()
    st = shutil.which("st") or shutil.which("schemathesis")
    if st is None:
        print("fuzz_serve: schemathesis is not installed: pip install -e '.[fuzz]'", file=sys.stderr)
        return 2
    serving = OpenAIServing.from_model(args.checkpoint, device="cpu", request_timeout=args.request_timeout)
    with BackgroundServer(create_app(serving)) as srv:
        cmd = [st, "run", f"{srv.url}/openapi.json", "--checks", "not_a_server_error",
               "--max-examples", str(args.max_examples), "--request-timeout", str(args.request_timeout + 5),
               "--suppress-health-check", "all"]
        return subprocess.run(cmd).returncode


if __name__ == "__main__":
    sys.exit(main())
