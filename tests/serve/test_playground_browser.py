"""The playground page in a real headless Chromium (Debian's ``chromium`` + ``chromium-driver``, driven by Selenium
with the driver path given, so nothing downloads) against a live ``celeris serve`` on the embedded models with an
API key. Screenshots go to an artifacts folder outside the repository (``$CELERIS_ARTIFACTS_DIR``, else a fresh
temporary folder; its path is printed). Skipped with a message where Chromium or Selenium is absent."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from celeris.llm import EMBEDDED
from tests.serve.test_serve_process import ServeProcess

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = "/usr/bin/chromedriver"
try:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait
except ImportError:  # pragma: no cover - the test extra installs it
    webdriver = None
if webdriver is None or CHROMIUM is None or not os.access(CHROMEDRIVER, os.X_OK):
    pytest.skip("the browser tests need Debian's chromium and chromium-driver (apt-get install -y chromium "
                "chromium-driver) and selenium (pip install -e '.[test]')", allow_module_level=True)

KEY = "playground-test-key"
HYBRID, DIFFUSION, AR = "celeris-code-6m-hybrid", "celeris-code-6m", "celeris-code-6m-ar"
PROMPT = "def fibonacci(n):"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--window-size=1280,1000"]
CELL_STEPS = """return [...document.querySelectorAll(arguments[0] + ' .cell.committed')]
    .map(c => (c.title.match(/committed at step (\\d+)$/) || [])[1]).filter(s => s !== undefined);"""
CELL_COUNTS = """const cells = [...document.querySelectorAll(arguments[0] + ' .cell')];
return {masked: cells.filter(c => c.classList.contains('masked')).length,
        committed: cells.filter(c => c.classList.contains('committed')).length};"""


@pytest.fixture(scope="module")
def artifacts(pytestconfig) -> Path:
    folder = Path(os.environ.get("CELERIS_ARTIFACTS_DIR") or tempfile.mkdtemp(prefix="celeris-playground-"))
    folder.mkdir(parents=True, exist_ok=True)
    with pytestconfig.pluginmanager.get_plugin("capturemanager").global_and_fixture_disabled():
        print(f"\nplayground screenshots: {folder}")
    return folder


@pytest.fixture(scope="module")
def server():
    srv = ServeProcess(EMBEDDED / HYBRID, "--also-serve", DIFFUSION, "--also-serve", AR, "--api-key", KEY)
    yield srv
    srv.stop()


@pytest.fixture
def browser(tmp_path):
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'chromium-profile'}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def open_page(driver, url: str, key: str = KEY) -> None:
    """Load the page, enter ``key`` (the page then lists the models)."""
    driver.get(url + "/")
    field = driver.find_element(By.ID, "api-key")
    field.clear()
    field.send_keys(key)
    driver.find_element(By.ID, "prompt").click()  # blur: the key's change event reloads the models
    if key == KEY:
        WebDriverWait(driver, 30).until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#model option")) == 3)


def set_field(driver, name: str, value: str) -> None:
    field = driver.find_element(By.ID, name)
    field.clear()
    field.send_keys(value)


def text_of(driver, element_id: str) -> str:
    return driver.execute_script("return document.getElementById(arguments[0]).textContent", element_id)


def api_answer(server, body: dict) -> dict:
    resp = httpx.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]


def aborted_disconnects(server, model: str) -> float:
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    pattern = rf'celeris_aborted_requests_total{{model="{re.escape(model)}",reason="disconnect"}} (\S+)'
    match = re.search(pattern, metrics)
    return float(match.group(1)) if match else 0.0


def test_page_is_open_and_lists_every_model_while_the_api_needs_the_key(server, browser):
    assert httpx.get(f"{server.url}/v1/models", timeout=10).status_code == 401
    open_page(browser, server.url)
    options = [o.get_attribute("value") for o in browser.find_elements(By.CSS_SELECTOR, "#model option")]
    assert options == [HYBRID, DIFFUSION, AR]
    presets = [o.text for o in browser.find_elements(By.CSS_SELECTOR, "#preset option")]
    assert presets[0].startswith("model defaults") and len(presets) >= 2
    assert "128 (default)" in browser.find_element(By.ID, "steps").get_attribute("placeholder")


def test_generate_fills_masked_cells_and_ends_with_the_api_answer(server, browser, artifacts):
    open_page(browser, server.url)
    set_field(browser, "max_tokens", "64")
    set_field(browser, "prompt", PROMPT)
    browser.find_element(By.ID, "generate").click()
    snapshots = []
    while text_of(browser, "status") == "generating":
        snapshots.append(browser.execute_script(CELL_COUNTS, "#gen-canvas"))
    assert text_of(browser, "status").startswith("done"), text_of(browser, "error")
    # the canvas was shown masked while the answer streamed, then filled over several steps (each cell names the
    # step that committed it); whether a poll also lands between two steps depends on the model's speed (on the
    # block kernel a 64-token answer takes a few tens of milliseconds), so it is not asked
    assert all(s["masked"] + s["committed"] > 0 for s in snapshots), snapshots[:5]  # a canvas while it streamed
    assert not snapshots or snapshots[0]["masked"] > 0, snapshots[:5]  # (polled only if it was still generating)
    steps = browser.execute_script(CELL_STEPS, "#gen-canvas")
    assert len(steps) > 0 and len(set(steps)) > 1, steps
    browser.save_screenshot(str(artifacts / "generate-end.png"))
    expected = api_answer(server, {"model": HYBRID, "prompt": PROMPT, "max_tokens": 64, "seed": 0})
    assert text_of(browser, "gen-text") == expected["text"]
    finish = text_of(browser, "gen-finish")
    assert f"finish_reason: {expected['finish_reason']}" in finish and "completion_tokens:" in finish
    assert int(text_of(browser, "gen-nfe")) == expected["celeris"]["nfe"]
    assert text_of(browser, "gen-ttft").endswith("ms") and float(text_of(browser, "gen-tps")) > 0
    final = browser.execute_script(CELL_COUNTS, "#gen-canvas")
    assert final["committed"] == 64 or expected["finish_reason"] == "stop"


def test_long_diffusion_answer_mid_generation_and_end_screenshots(server, browser, artifacts):
    open_page(browser, server.url)
    Select(browser.find_element(By.ID, "model")).select_by_value(DIFFUSION)
    set_field(browser, "max_tokens", "256")
    set_field(browser, "steps", "256")
    set_field(browser, "block_length", "64")
    set_field(browser, "prompt", "class Stack:")
    browser.find_element(By.ID, "generate").click()
    WebDriverWait(browser, 60, poll_frequency=0.05).until(
        lambda d: d.execute_script(CELL_COUNTS, "#gen-canvas")["committed"] >= 40)
    counts = browser.execute_script(CELL_COUNTS, "#gen-canvas")
    browser.save_screenshot(str(artifacts / "generate-mid.png"))
    assert counts["masked"] > 0 and text_of(browser, "status") == "generating"  # really mid-generation
    WebDriverWait(browser, 120).until(lambda d: text_of(d, "status") != "generating")
    browser.save_screenshot(str(artifacts / "generate-long-end.png"))
    assert text_of(browser, "status").startswith("done"), text_of(browser, "error")
    expected = api_answer(server, {"model": DIFFUSION, "prompt": "class Stack:", "max_tokens": 256, "steps": 256,
                                   "block_length": 64, "seed": 0})
    assert text_of(browser, "gen-text") == expected["text"]
    assert (artifacts / "generate-mid.png").stat().st_size > 10_000


def test_race_runs_two_models_side_by_side_and_measures_each_alone(server, browser, artifacts):
    open_page(browser, server.url)
    set_field(browser, "max_tokens", "32")
    browser.find_element(By.ID, "tab-race").click()
    Select(browser.find_element(By.ID, "race-a")).select_by_value(DIFFUSION)
    Select(browser.find_element(By.ID, "race-b")).select_by_value(AR)
    browser.find_element(By.ID, "race").click()
    WebDriverWait(browser, 120).until(lambda d: text_of(d, "race-status") in ("done", "error", "stopped"))
    browser.save_screenshot(str(artifacts / "race-end.png"))
    assert text_of(browser, "race-status") == "done", text_of(browser, "error")
    for lane, model in (("a", DIFFUSION), ("b", AR)):
        assert text_of(browser, f"race-{lane}-title") == model
        assert "finish_reason:" in text_of(browser, f"race-{lane}-finish")
        racing, alone = re.findall(r"[\d.]+", text_of(browser, f"race-{lane}-rates"))
        assert float(racing) > 0 and float(alone) > 0
        expected = api_answer(server, {"model": model, "prompt": PROMPT, "max_tokens": 32, "seed": 0})
        assert text_of(browser, f"race-{lane}-text") == expected["text"]


def test_stop_aborts_the_request(server, browser):
    open_page(browser, server.url)
    Select(browser.find_element(By.ID, "model")).select_by_value(DIFFUSION)
    set_field(browser, "max_tokens", "256")
    set_field(browser, "steps", "256")
    before = aborted_disconnects(server, DIFFUSION)
    browser.find_element(By.ID, "generate").click()
    WebDriverWait(browser, 60, poll_frequency=0.05).until(
        lambda d: d.execute_script(CELL_COUNTS, "#gen-canvas")["committed"] >= 1)
    browser.find_element(By.ID, "stop").click()
    WebDriverWait(browser, 10).until(lambda d: text_of(d, "status") == "stopped")
    assert "aborted" in text_of(browser, "gen-finish")
    assert browser.execute_script(CELL_COUNTS, "#gen-canvas")["masked"] > 0
    deadline = time.monotonic() + 15  # the server notices the closed stream and aborts the engine request
    while aborted_disconnects(server, DIFFUSION) <= before:
        assert time.monotonic() < deadline, "the server did not abort the request after Stop"
        time.sleep(0.2)


def test_a_bad_api_key_shows_a_readable_error(server, browser):
    open_page(browser, server.url, key="not-the-key")
    WebDriverWait(browser, 10).until(lambda d: d.find_element(By.ID, "error").is_displayed())
    message = text_of(browser, "error")
    assert message.startswith("401 invalid_api_key: invalid or missing API key"), message
    browser.find_element(By.ID, "generate").click()
    WebDriverWait(browser, 10).until(lambda d: text_of(d, "status") == "error")
    assert "invalid or missing API key" in text_of(browser, "error")


def test_view_code_and_a_narrow_window(server, browser):
    open_page(browser, server.url)
    set_field(browser, "steps", "32")
    browser.find_element(By.ID, "view-code").click()
    curl, python = text_of(browser, "code-curl"), text_of(browser, "code-python")
    assert f"{server.url}/v1/completions" in curl and '"steps": 32' in curl and "Authorization: Bearer" in curl
    assert "client.completions.create(" in python and "extra_body={\"steps\":32}" in python
    browser.find_element(By.CSS_SELECTOR, "#code-dialog button").click()
    browser.set_window_size(400, 900)
    layout = browser.execute_script("""return {scroll: document.documentElement.scrollWidth, width: innerWidth,
        aside: document.getElementById('settings').getBoundingClientRect().bottom,
        view: document.getElementById('view-generate').getBoundingClientRect().top};""")
    assert layout["scroll"] <= layout["width"] and layout["aside"] <= layout["view"], layout


def test_chat_mode_with_a_system_prompt(server, browser):
    open_page(browser, server.url)
    browser.find_element(By.CSS_SELECTOR, "input[name=mode][value=chat]").click()
    assert browser.find_element(By.ID, "system").is_displayed()
    set_field(browser, "system", "Answer with code only.")
    set_field(browser, "prompt", "write a fibonacci function")
    set_field(browser, "max_tokens", "24")
    browser.find_element(By.ID, "generate").click()
    WebDriverWait(browser, 60).until(lambda d: text_of(d, "status") != "generating")
    assert text_of(browser, "status").startswith("done"), text_of(browser, "error")
    messages = [{"role": "system", "content": "Answer with code only."},
                {"role": "user", "content": "write a fibonacci function"}]
    resp = httpx.post(f"{server.url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                      json={"model": HYBRID, "messages": messages, "max_tokens": 24, "seed": 0})
    assert text_of(browser, "gen-text") == resp.json()["choices"][0]["message"]["content"]


MARKUP = "m<img src=x onerror=\"document.title='XSS'\">"
SCRIPT_MARKUP = "<script>document.title='XSS2'</script>b"


@pytest.fixture(scope="module")
def markup_server(tmp_path_factory):
    """Two models behind one in-process server (``ModelRouter``, as ``--also-serve``) whose ids and card fields
    carry markup: what a checkpoint folder named ``m<img ...>`` would put into the page."""
    from celeris.config import EngineConfig
    from celeris.llm import LLM
    from celeris.serve.app import BackgroundServer, create_app
    from celeris.serve.metrics import ServerMetrics
    from celeris.serve.models_router import ModelRouter
    from celeris.serve.serving import OpenAIServing
    from tests.serve.conftest import build_checkpoint

    class MarkupCards(OpenAIServing):
        def model_card(self):
            card = super().model_card()
            fields = {**card.generation_config, "decoding": MARKUP, "cache": SCRIPT_MARKUP, "steps": MARKUP}
            return card.model_copy(update={"decoding_kind": SCRIPT_MARKUP, "generation_config": fields})

    llm = LLM(build_checkpoint(tmp_path_factory.mktemp("markup")), device="cpu")
    shared = ServerMetrics()
    servings = [MarkupCards(llm, served_model_name=name, metrics=shared,
                            engine_config=EngineConfig(max_num_seqs=2, max_waiting=4))
                for name in (MARKUP, SCRIPT_MARKUP)]
    with BackgroundServer(create_app(ModelRouter(servings))) as srv:
        yield srv


def test_markup_in_model_ids_and_cards_is_shown_as_text(markup_server, browser):
    """The Race view used to build its lane titles with innerHTML: a model id ``m<img src=x onerror=...>`` ran its
    script when a race started. Every server string is text now, and the page's CSP would block inline handlers."""
    browser.get(markup_server.url + "/")
    WebDriverWait(browser, 30).until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#model option")) == 2)
    options = [o.get_attribute("value") for o in browser.find_elements(By.CSS_SELECTOR, "#model option")]
    assert options == [MARKUP, SCRIPT_MARKUP]
    assert browser.find_element(By.CSS_SELECTOR, "#model option").text == f"{MARKUP} ({SCRIPT_MARKUP})"
    assert MARKUP in browser.find_element(By.ID, "steps").get_attribute("placeholder")
    set_field(browser, "max_tokens", "8")
    browser.find_element(By.ID, "tab-race").click()
    Select(browser.find_element(By.ID, "race-b")).select_by_value(SCRIPT_MARKUP)
    browser.find_element(By.ID, "race").click()
    WebDriverWait(browser, 60).until(lambda d: text_of(d, "race-status") in ("done", "error", "stopped"))
    assert text_of(browser, "race-status") == "done", text_of(browser, "error")  # the page works under its CSP
    assert text_of(browser, "race-a-title") == MARKUP and text_of(browser, "race-b-title") == SCRIPT_MARKUP
    found = browser.execute_script("""return {title: document.title,
        images: document.querySelectorAll('img').length,
        scripts: [...document.scripts].map((s) => s.getAttribute('src')),
        handlers: [...document.querySelectorAll('*')].filter((e) =>
            [...e.attributes].some((a) => a.name.startsWith('on'))).length};""")
    assert found == {"title": "Celeris playground", "images": 0, "scripts": ["/static/playground.js"],
                     "handlers": 0}
