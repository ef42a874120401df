"""The playground (/) and the dashboard (/dashboard) in a real browser: headless Chromium driven by
Selenium (Debian's chromium + chromium-driver; `make install` installs them where it runs as root).
Screenshots of each page at 1280 and 360 px go to the test's output folder (and to
$RADIXSERVE_SCREENSHOTS when set: docs/images/ holds the README's)."""

import json
import os
import shutil
import threading
import time

import pytest
import requests

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None or DRIVER is None,
    reason="needs Debian's chromium and chromium-driver (make install adds them when run as root)",
)
webdriver = pytest.importorskip("selenium.webdriver")
from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

KEY = "sk-webui"
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "color"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


@pytest.fixture(scope="module")
def keyed(shared_server, tiny_chat_model):
    return shared_server("--model-path", tiny_chat_model, "--max-total-tokens", "8192", "--api-key", KEY)


@pytest.fixture
def browser(tmp_path):
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--window-size=1280,900",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=DRIVER), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def wait(driver, predicate, timeout=60, what=""):
    """Poll `predicate` (the page re-renders under it: stale and missing elements are retried)."""
    ignored = (StaleElementReferenceException, NoSuchElementException, IndexError, ValueError)
    return WebDriverWait(driver, timeout, 0.1, ignored_exceptions=ignored).until(predicate, message=what)


def screenshots(driver, name, tmp_path):
    """The page at 1280 and 360 px wide; at 360 px nothing may be wider than the window."""
    for width in (1280, 360):
        driver.set_window_size(width, 900)
        time.sleep(0.3)
        overflow = driver.execute_script("return document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 0, f"{name} is {overflow}px wider than a {width}px window"
        for folder in filter(None, (str(tmp_path), os.environ.get("RADIXSERVE_SCREENSHOTS"))):
            os.makedirs(folder, exist_ok=True)
            driver.save_screenshot(os.path.join(folder, f"{name}-{width}.png"))
    driver.set_window_size(1280, 900)


def check_clean(driver, url):
    """No console errors, and no request to any host but the server."""
    errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors
    for entry in driver.get_log("performance"):
        msg = json.loads(entry["message"])["message"]
        if msg["method"] == "Network.requestWillBeSent":
            target = msg["params"]["request"]["url"]
            if target.startswith(("http:", "https:", "ws:", "wss:")):  # not chrome:// internals or data:
                assert target.startswith(url + "/"), target


def last_figures(driver) -> str:
    found = driver.find_elements(By.CSS_SELECTOR, ".msg.assistant .figures")
    return found[-1].text if found else ""


def set_field(driver, element_id, value):
    el = driver.find_element(By.ID, element_id)
    driver.execute_script("arguments[0].value = arguments[1]", el, str(value))


def test_chat_streams_stops_and_regenerates(browser, server, tmp_path):
    browser.get(server.url + "/")
    wait(browser, lambda d: "context" in d.find_element(By.ID, "model").text, what="the model line from /props")
    browser.find_element(By.CSS_SELECTOR, "#settings summary").click()
    set_field(browser, "max_tokens", 24)
    set_field(browser, "temperature", 0)
    prompt = browser.find_element(By.ID, "prompt")
    prompt.send_keys("Tell me a story")
    prompt.send_keys(Keys.ENTER)  # the keyboard sends
    wait(browser, lambda d: "tok/s" in last_figures(d), what="figures")
    figures = last_figures(browser)
    assert "prompt tokens" in figures and "cached" in figures and "TTFT" in figures
    first = browser.find_element(By.CSS_SELECTOR, ".msg.assistant .text").text
    assert first.strip()

    # a long answer, stopped half-way (the tiny model streams 1,500 tokens in about half a second here, so
    # the answer may run to 6,000 and the stop comes as soon as its first text shows)
    set_field(browser, "max_tokens", 6000)
    prompt.send_keys("Go on, at length")
    browser.find_element(By.ID, "send").click()
    wait(browser, lambda d: d.find_element(By.ID, "stop").is_displayed(), what="the stop button")
    wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant .text")[-1].text.strip(), what="text")
    browser.find_element(By.ID, "stop").click()
    wait(browser, lambda d: "stopped" in d.find_elements(By.CSS_SELECTOR, ".msg.assistant .figures")[-1].text, 30)
    assert browser.find_element(By.ID, "send").is_displayed()

    # regenerate the last answer (seeded, greedy: the same text again), then edit and resend
    set_field(browser, "max_tokens", 24)
    before = len(browser.find_elements(By.CSS_SELECTOR, ".msg"))
    browser.find_element(By.CSS_SELECTOR, ".msg.assistant:last-child .regenerate").click()
    wait(browser, lambda d: "tok/s" in d.find_elements(By.CSS_SELECTOR, ".msg.assistant .figures")[-1].text)
    assert len(browser.find_elements(By.CSS_SELECTOR, ".msg")) == before
    browser.find_elements(By.CSS_SELECTOR, ".msg.user .edit")[0].click()
    area = browser.find_element(By.CSS_SELECTOR, ".msg textarea")
    area.clear()
    area.send_keys("Tell me another story")
    browser.find_element(By.XPATH, "//button[text()='Save and resend']").click()
    wait(
        browser,
        lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg")) == 2,
        what="the conversation cut after the edit",
    )
    wait(browser, lambda d: "tok/s" in d.find_elements(By.CSS_SELECTOR, ".msg.assistant .figures")[-1].text)
    assert browser.find_elements(By.CSS_SELECTOR, ".msg.user .text")[0].text == "Tell me another story"

    # kept in the browser: a reload shows the conversation
    browser.refresh()
    wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg")) == 2, what="the stored conversation")
    stored = browser.execute_script("return JSON.parse(localStorage.getItem('radixserve.conversations'))")
    assert stored[0]["messages"][0]["content"] == "Tell me another story"
    screenshots(browser, "playground", tmp_path)
    check_clean(browser, server.url)


def test_structured_output_validates(browser, server):
    browser.get(server.url + "/")
    wait(browser, lambda d: "context" in d.find_element(By.ID, "model").text)
    browser.find_element(By.ID, "tab-structured").click()
    set_field(browser, "schema", json.dumps(SCHEMA, indent=2))
    browser.find_element(By.CSS_SELECTOR, "#settings summary").click()
    set_field(browser, "max_tokens", 256)
    browser.find_element(By.ID, "structured-run").click()
    wait(browser, lambda d: d.find_element(By.ID, "structured-check").text, what="the check line")
    assert browser.find_element(By.ID, "structured-check").text.startswith("Valid"), browser.find_element(
        By.ID, "structured-check"
    ).text
    value = json.loads(browser.find_element(By.ID, "structured-out").text)
    assert (
        set(value) == {"ok", "color"} and isinstance(value["ok"], bool) and value["color"] in ("red", "green", "blue")
    )
    # raw completion continues the text
    browser.find_element(By.ID, "tab-completion").click()
    before = browser.find_element(By.ID, "completion-text").get_property("value")
    set_field(browser, "max_tokens", 8)
    browser.find_element(By.ID, "complete").click()
    wait(
        browser,
        lambda d: (
            "tok/s" in d.find_element(By.ID, "completion-figures").text
            or "out" in d.find_element(By.ID, "completion-figures").text
        ),
    )
    assert len(browser.find_element(By.ID, "completion-text").get_property("value")) > len(before)
    check_clean(browser, server.url)


def test_api_key_prompt(browser, keyed):
    browser.get(keyed.url + "/")
    wait(browser, lambda d: d.find_element(By.ID, "key-dialog").is_displayed(), what="the key dialog")
    browser.find_element(By.ID, "key-input").send_keys(KEY)
    browser.find_element(By.CSS_SELECTOR, "#key-dialog button[value=ok]").click()
    wait(browser, lambda d: "context" in d.find_element(By.ID, "model").text, what="/props with the key")
    assert browser.execute_script("return localStorage.getItem('radixserve.apiKey')") is None  # session only
    assert browser.execute_script("return sessionStorage.getItem('radixserve.apiKey')") == KEY


def test_dashboard_follows_load(browser, server, tmp_path):
    stop = threading.Event()

    def load():
        while not stop.is_set():
            body = {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
            requests.post(server.url + "/generate", json=body, timeout=120)

    threads = [threading.Thread(target=load, daemon=True) for _ in range(3)]
    browser.get(server.url + "/dashboard")
    wait(browser, lambda d: "polls" in d.find_element(By.ID, "updated").text, what="the first state")
    for t in threads:
        t.start()
    try:
        wait(
            browser, lambda d: int(d.find_element(By.ID, "card-running").text or 0) >= 1, what="running requests shown"
        )
        out1 = int(browser.find_element(By.ID, "card-generated").text.replace(",", ""))
        wait(
            browser,
            lambda d: int(d.find_element(By.ID, "card-generated").text.replace(",", "")) > out1,
            what="a rising count",
        )
        wait(browser, lambda d: float(d.find_element(By.ID, "chart-tokensOut-max").text.replace(",", "")) > 0)
        wait(browser, lambda d: d.execute_script("return polls") >= 8, what="a few seconds of charts")
        screenshots(browser, "dashboard", tmp_path)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    check_clean(browser, server.url)
