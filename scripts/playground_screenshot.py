"""Regenerate docs/playground.png: the playground page mid-generation (the embedded masked-diffusion model
filling a 128-token answer in blocks of 32, out of order).

Starts ``celeris serve`` (the embedded models) on a free loopback port, drives Debian's headless Chromium with
Selenium (driver path given: nothing downloads), presses Generate and saves the page while cells are still masked.

    python scripts/playground_screenshot.py [--out docs/playground.png]

Needs ``apt-get install -y chromium chromium-driver`` and ``pip install -e '.[test]'`` (selenium).
Exits 1 with one line when Chromium, the driver or the server is missing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
CHROMEDRIVER = "/usr/bin/chromedriver"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
         "--window-size=1280,900", "--hide-scrollbars"]
MODEL = "celeris-code-6m"
COUNTS = """const cells = [...document.querySelectorAll('#gen-canvas .cell')];
return [cells.filter(c => c.classList.contains('committed')).length, cells.length];"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    env.pop("CELERIS_API_KEY", None)
    proc = subprocess.Popen([sys.executable, "-m", "celeris.cli", "serve", "--port", str(port), "--also-serve", MODEL,
                             "--log-level", "warning"], env=env, cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("celeris serve did not come up")


def capture(url: str, out: Path, attempts: int = 3) -> tuple[int, int]:
    """Screenshot the page while the answer is 30-80 % committed; returns (committed, cells) at that moment."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "chromium"
    for flag in [*FLAGS, f"--user-data-dir={tempfile.mkdtemp(prefix='celeris-chromium-')}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        driver.get(url + "/")
        WebDriverWait(driver, 30).until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#model option")) >= 2)
        Select(driver.find_element(By.ID, "model")).select_by_value(MODEL)
        for name, value in (("max_tokens", "128"), ("steps", "128"), ("block_length", "32"),
                            ("prompt", "class Stack:\n    def __init__(self):")):
            field = driver.find_element(By.ID, name)
            field.clear()
            field.send_keys(value)
        for _ in range(attempts):
            driver.find_element(By.ID, "generate").click()
            WebDriverWait(driver, 60, poll_frequency=0.02).until(
                lambda d: d.execute_script(COUNTS)[0] >= 0.3 * d.execute_script(COUNTS)[1] > 0)
            committed, cells = driver.execute_script(COUNTS)
            driver.save_screenshot(str(out))
            mid = driver.find_element(By.ID, "status").text == "generating"
            WebDriverWait(driver, 120).until(lambda d: d.find_element(By.ID, "status").text != "generating")
            if mid and committed < 0.8 * cells:
                return committed, cells
        raise SystemExit(f"no mid-generation frame in {attempts} attempts (the answer finished too fast)")
    finally:
        driver.quit()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "playground.png")
    args = parser.parse_args()
    if not shutil.which("chromium") or not os.access(CHROMEDRIVER, os.X_OK):
        print("needs Debian's chromium and chromium-driver: apt-get install -y chromium chromium-driver", file=sys.stderr)
        return 1
    try:
        import selenium  # noqa: F401
    except ImportError:
        print("needs selenium: pip install -e '.[test]'", file=sys.stderr)
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    port = free_port()
    server = start_server(port)
    try:
        committed, cells = capture(f"http://127.0.0.1:{port}", args.out)
    finally:
        server.terminate()
        server.wait(timeout=30)
    print(f"wrote {args.out} ({committed} of {cells} cells committed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
