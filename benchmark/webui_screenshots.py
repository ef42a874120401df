"""The README's screenshots of the playground and the dashboard (docs/images/), on the default model.

    python benchmark/webui_screenshots.py                  # writes docs/images/{playground,dashboard}-{1280,360}.png
    python benchmark/webui_screenshots.py --out /tmp/shots --server-args "--max-running-requests 8"

Starts a server (default model, `--server-args`), opens / in headless Chromium (Debian's chromium and
chromium-driver, as tests/webui), asks one question, waits for the streamed answer and its figures, and
captures the page at 1280 and 360 px; then opens /dashboard while 8 requests of 256 tokens run and captures
it after 15 s of charts.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402
from bench_quant import our_server  # noqa: E402
from selenium import webdriver  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def browser(profile: str):
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    for flag in (
        "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=1280,900",
    ):  # fmt: skip
        options.add_argument(flag)
    service = webdriver.ChromeService(executable_path=shutil.which("chromedriver") or "/usr/bin/chromedriver")
    return webdriver.Chrome(service=service, options=options)


def shoot(driver, out: str, name: str) -> None:
    for width in (1280, 360):
        driver.set_window_size(width, 900)
        time.sleep(0.5)
        path = os.path.join(out, f"{name}-{width}.png")
        driver.save_screenshot(path)
        print("wrote", path)
    driver.set_window_size(1280, 900)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "images"))
    p.add_argument("--question", default="What is a radix tree? Answer in three short points.")
    p.add_argument("--server-args", default="")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    from srt.model_loader.default_model import resolve_model_path

    model = resolve_model_path(None)
    with our_server(model, shlex.split(args.server_args), len(os.sched_getaffinity(0))) as server:
        profile = os.path.join(args.out, ".profile")
        driver = browser(profile)
        try:
            wait = WebDriverWait(driver, 120, 0.2)
            driver.get(server.url + "/")
            wait.until(lambda d: "context" in d.find_element(By.ID, "model").text)
            prompt = driver.find_element(By.ID, "prompt")
            prompt.send_keys(args.question)
            prompt.send_keys(Keys.ENTER)
            wait.until(
                lambda d: "tok/s" in (d.find_elements(By.CSS_SELECTOR, ".msg.assistant .figures") or [None])[-1].text
            )
            shoot(driver, args.out, "playground")
            stop = threading.Event()

            def load() -> None:
                body = {"text": "Write a long story about a lighthouse.", "sampling_params": {"max_new_tokens": 256}}
                while not stop.is_set():
                    httpx.post(server.url + "/generate", json=body, timeout=600)

            threads = [threading.Thread(target=load, daemon=True) for _ in range(8)]
            for t in threads:
                t.start()
            driver.get(server.url + "/dashboard")
            time.sleep(15)
            shoot(driver, args.out, "dashboard")
            stop.set()
            for t in threads:
                t.join(timeout=600)
        finally:
            driver.quit()
            shutil.rmtree(profile, ignore_errors=True)


if __name__ == "__main__":
    main()
