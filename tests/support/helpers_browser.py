"""A real headless Chromium for the dashboard's tests (Debian's ``chromium`` + ``chromium-driver``,
installed by scripts/test.sh), driven with selenium. A missing browser fails the test, never skips it."""
from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any, Callable

import pytest


def chromium() -> Any:
    """A headless Chromium under selenium (the caller quits it)."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.fail("the dashboard tests need selenium (pip install -e .[dev])")
    driver_path, browser = shutil.which("chromedriver"), shutil.which("chromium")
    if not driver_path or not browser:
        pytest.fail("the dashboard tests need Chromium and its driver: apt-get install -y chromium chromium-driver "
                    "(scripts/test.sh installs them)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,1000", "--no-first-run", "--disable-extensions"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(driver_path), options=opts)
    driver.set_page_load_timeout(30)
    driver.set_script_timeout(30)
    return driver


def wait_for(driver: Any, what: str, check: Callable[[], Any], timeout: float, shot: Path) -> Any:
    """``check()``'s first true value within ``timeout`` seconds; else a screenshot at ``shot`` and a
    failure naming ``what``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = check()
        except Exception as exc:  # an element replaced by the next redraw: look again
            last = exc
        else:
            if last:
                return last
        if time.monotonic() > deadline:
            driver.save_screenshot(str(shot))
            pytest.fail(f"the dashboard did not show {what} within {timeout} s (last: {last!r}); screenshot {shot}")
        time.sleep(0.1)


def text_of(driver: Any, css: str) -> str:
    """The text of the first element matching ``css`` ('' if none), read in the page in one go."""
    return driver.execute_script("const e = document.querySelector(arguments[0]); return e ? e.textContent : '';", css)
