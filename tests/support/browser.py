"""Headless Chromium for the admin's pages (Debian's chromium and chromedriver), through
selenium: the ``browser`` fixture, logging in, and saving screenshots for the docs.

With ``IDEMPOTENCY_SCREENSHOTS=<folder>`` a test's screenshots are saved there too (the
ones in ``docs/_static/`` come from such a run)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.urls import reverse

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
PASSWORD = "browser-test-password"

needs_chromium = pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason="no headless browser: /usr/bin/chromium is absent "
    "(apt-get install chromium chromium-driver)",
)


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    webdriver = pytest.importorskip(
        "selenium.webdriver", reason="selenium is not installed (it is in the test group)"
    )
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        # Without these, Chromium's background connections are refused by a closed network.
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--window-size=1280,900",
    ):
        options.add_argument(argument)
    driver_path = str(CHROMEDRIVER) if CHROMEDRIVER.exists() else None
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(driver_path))
    try:
        yield driver
    finally:
        driver.quit()


def log_in(browser: Any, live_server: Any, username: str) -> None:
    """Log in through the admin's own form, as a person would."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(live_server.url + reverse("admin:login"))
    browser.find_element(By.NAME, "username").send_keys(username)
    browser.find_element(By.NAME, "password").send_keys(PASSWORD)
    browser.find_element(By.CSS_SELECTOR, "input[type=submit]").click()
    # The click returns before the browser has followed the login's redirect.
    WebDriverWait(browser, 30).until(lambda driver: "/admin/login/" not in driver.current_url)


def screenshot(browser: Any, tmp_path: Path, name: str) -> Path:
    """Save the window as ``name``.png in ``tmp_path``, and in $IDEMPOTENCY_SCREENSHOTS."""
    path = tmp_path / f"{name}.png"
    browser.save_screenshot(str(path))
    folder = os.environ.get("IDEMPOTENCY_SCREENSHOTS")
    if folder:
        (Path(folder) / path.name).write_bytes(path.read_bytes())
    return path
