"""The live page in a real headless browser (Debian's chromium + chromium-driver, driven by
Selenium): it loads without console errors and updates while requests run.

Skips only where no chromium binary exists (`make browser` installs it as root), and never
where the CI env var is set: there a missing browser fails the test.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.chrome.webdriver import WebDriver
from selenium.webdriver.common.by import By

from pdserve.access import ADMIN_KEY_ENV
from tests.fake_engine import FakeEngine
from tests.gateway.test_app import MODEL, post, ready_gateway_over
from tests.gateway.test_kv_monitor import vllm_metrics

T = TypeVar("T")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
ADMIN_KEY = "sk-admin-0123456789abcdef"
# Where to keep a screenshot of the page with requests on it (docs/dashboard.png is one).
SCREENSHOT_ENV = "PDSERVE_DASHBOARD_SCREENSHOT"


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    if CHROMIUM is None:
        reason = ("NO CHROMIUM: the live page's browser test did NOT run. Install it with `make browser` as root "
                  "(apt-get install -y chromium chromium-driver)")
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    assert CHROMEDRIVER is not None, "chromium is installed but chromedriver is not: apt-get install chromium-driver"
    options = Options()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                     "--window-size=1400,1100", "--no-first-run", "--disable-extensions"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


async def browse(call: Callable[..., T], *args: Any) -> T:
    """Selenium blocks: run it off the event loop, which serves the gateway the browser talks to."""
    return await asyncio.to_thread(call, *args)


async def wait_for(driver: WebDriver, script: str, *, timeout_s: float = 15.0) -> Any:
    """Poll the page until ``script`` (a JS expression) is truthy; returns its value."""
    value = None
    for _ in range(int(timeout_s / 0.2)):
        value = await browse(driver.execute_script, f"return {script};")
        if value:
            return value
        await asyncio.sleep(0.2)
    page = await browse(driver.find_element, By.TAG_NAME, "body")
    raise AssertionError(f"never true on the page: {script} (last {value!r}); page text:\n{page.text}")


def console_errors(driver: WebDriver) -> list[dict[str, Any]]:
    return [entry for entry in driver.get_log("browser") if entry["level"] in ("SEVERE", "WARNING")]


async def test_the_page_loads_clean_and_updates_while_requests_run(browser: WebDriver) -> None:
    fake = FakeEngine(token_delay_s=0.01, metrics_text=vllm_metrics([], running=1))
    async with ready_gateway_over(fake, kv_scrape_interval_s=0.3) as base:
        browser.get_log("browser")  # from any earlier page
        await browse(browser.get, base + "/dashboard")
        assert await browse(lambda: browser.title) == "pdserve"
        await wait_for(browser, "document.querySelectorAll('#engines tr').length === 2")
        await wait_for(browser, "document.getElementById('health').textContent.includes('2 of 2 healthy')")

        ids = [f"page-{index}" for index in range(6)]
        for round_index in range(3):  # requests in flight across several polls; KV counters move between reads
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 5, "stream": True}
            replies = await asyncio.gather(*(post(base, body, headers={"X-Request-Id": request_id})
                                             for request_id in ids[round_index * 2:round_index * 2 + 2]))
            assert all(status == 200 for status, _ in replies)
            fake.metrics_text = vllm_metrics([0.004] * 4 * (round_index + 1), running=1)
            await asyncio.sleep(1.2)

        shown = await wait_for(browser, f"""(() => {{
            const rows = [...document.querySelectorAll('#requests tr')].map((row) => row.dataset.requestId);
            return {ids!r}.every((id) => rows.includes(id)) && rows; }})()""")
        assert shown.index("page-5") < shown.index("page-0")  # newest first
        # One script reads both tables: the page rebuilds them every poll, so element handles go stale.
        cells, engine = await browse(browser.execute_script, """return [
            [...document.querySelectorAll("#requests tr[data-request-id='page-0'] td")].map((td) => td.textContent),
            document.querySelector("#engines tr td:nth-child(2)").textContent];""")
        assert cells[2] == "pd" and cells[3] == cells[4] == engine and cells[-1] == "ok"
        assert float(cells[5]) > 0 and float(cells[6]) > 0  # TTFT and handoff, in ms
        for chart in ("ttft", "itl", "kv"):
            await wait_for(browser, f"Number(document.getElementById('chart-{chart}').dataset.points) > 0")
        assert await browse(browser.execute_script, "return document.querySelectorAll('#chart-ttft path').length") > 0
        # 0.1 MB in 4 ms a transfer: 0.025 GB/s, under the bar's rate (gateway.slow_kv_gbps, 0.5 GB/s), and no alarm:
        # the gateway allows each transfer 100 ms (gateway.slow_kv_min_ms), and the page shows the gateway's verdict
        assert await browse(browser.execute_script, "return document.querySelectorAll('#chart-kv .bar-line').length") == 1
        note = await wait_for(browser, "document.getElementById('kv-bar-note').textContent.startsWith('KV at') && "
                                       "document.getElementById('kv-bar-note').textContent")
        assert "0.025 GB/s, not slow by the gateway's bar: 0.5 GB/s, allowing 100 ms a transfer" in note
        assert await browse(browser.execute_script, "return document.getElementById('kv-bar-note').className") == ""
        assert "lost" not in await browse(browser.find_element(By.ID, "connection").get_attribute, "class")
        if screenshot := os.environ.get(SCREENSHOT_ENV):
            await browse(browser.save_screenshot, str(Path(screenshot).resolve()))
        errors = await browse(console_errors, browser)
        await browse(browser.get, "about:blank")  # stop polling before the gateway goes
    assert not errors, f"the page logged errors: {errors}"


async def test_behind_an_admin_key_the_browser_gets_in_with_it(browser: WebDriver,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ADMIN_KEY_ENV, ADMIN_KEY)
    async with ready_gateway_over(FakeEngine()) as base:
        browser.get_log("browser")
        # What a login prompt would send: the key as the Basic password; the page's polls reuse it.
        await browse(browser.get, base.replace("http://", f"http://admin:{ADMIN_KEY}@") + "/dashboard")
        await wait_for(browser, "document.querySelectorAll('#engines tr').length === 2")
        await asyncio.sleep(1.5)  # a few more polls, each of which must get in
        assert "updated" in await browse(lambda: browser.find_element(By.ID, "connection").text)
        errors = await browse(console_errors, browser)
        await browse(browser.get, "about:blank")
    assert not errors, f"the page logged errors: {errors}"

