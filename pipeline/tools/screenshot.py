"""Open a page in headless Chromium from Debian (no browser download) with every network request
refused, and what the browser tests and `nexttoken screenshot` need from it.

`browser()` starts /usr/bin/chromium through Selenium and /usr/bin/chromedriver, with the
flags that keep a closed machine quiet (no background networking, component updates or sync)
and DevTools' performance log on, so `requests(driver)` lists every request the page made.
`available()` says why not when either piece is missing. Selenium comes with the test tools
(`pip install -e '.[test]'`); Chromium with `apt-get install chromium chromium-driver`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from pipeline.errors import UserError

CHROMIUM, DRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-default-apps", "--disable-extensions", "--window-size=1400,1800")


def available() -> str | None:
    """None when a page can be opened here, else what is missing (one line)."""
    missing = [p for p in (CHROMIUM, DRIVER) if not Path(p).exists() and not shutil.which(Path(p).name)]
    if missing:
        return f"no {' or '.join(missing)}: apt-get install chromium chromium-driver"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "no selenium: pip install selenium (it comes with the test tools, pip install -e '.[test]')"
    return None


@contextlib.contextmanager
def browser(env: dict[str, str] | None = None) -> Iterator:
    """A headless Chromium driven by Selenium, in a fresh profile that is deleted afterwards; `env`: variables
    for the driver and the browser beside this process's (FONTCONFIG_FILE, say, for a machine with other fonts)."""
    if why := available():
        raise UserError(f"cannot open a browser here: {why}")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="nexttoken-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or CHROMIUM
    for flag in (*FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    service = Service(shutil.which("chromedriver") or DRIVER, env={**os.environ, **env} if env else None)
    driver = webdriver.Chrome(service=service, options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def requests(driver) -> list[str]:
    """The URL of every request the browser sent since the last call (DevTools' Network events)."""
    out = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message.get("method") == "Network.requestWillBeSent":
            out.append(message["params"]["request"]["url"])
    return out


def console_errors(driver) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e.get("level") == "SEVERE"]


SCREEN = (1280, 720)     # a projector's screen: what `screens` shows, section by section


def _page(page: Path) -> Path:
    page = Path(page).resolve()
    if not page.is_file():
        raise UserError(f"{page}: no such page (run `dvc repro` to make artifacts/report/explorer.html)")
    return page


def shoot(page: Path, out: Path) -> Path:
    """A PNG of the whole page, opened from file:// in a browser that sends nothing anywhere."""
    page = _page(page)
    with browser() as driver:
        driver.get(page.as_uri())
        height = driver.execute_script("return document.body.scrollHeight")
        driver.set_window_size(1400, min(max(height, 900), 6000))
        driver.save_screenshot(str(out))
    return out


def set_screen(driver, width: int = SCREEN[0], height: int = SCREEN[1]) -> None:
    """The page's viewport exactly width x height CSS pixels (a window size would include the browser's frame)."""
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                           {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})


LANGUAGES = ("en", "zh")      # the page's #language choices


def screens(page: Path) -> list[Path]:
    """1280 x 720 PNGs beside the page, in each language: its first screen (<stem>-screen-<lang>-first.png), then
    each section (the panels and the walk's steps) scrolled to the top of the screen
    (<stem>-screen-<lang>-<section id>.png), as a projector shows them."""
    page = _page(page)
    out = []
    with browser() as driver:
        set_screen(driver)
        driver.get(page.as_uri())
        driver.execute_script("return document.fonts.ready")
        sections = driver.execute_script(
            "return [...document.querySelectorAll('main > section[id], #walk > section[id]')].map(s => s.id)")
        for lang in LANGUAGES:
            driver.execute_script("const s = document.getElementById('language'); s.value = arguments[0];"
                                  "s.dispatchEvent(new Event('change')); window.scrollTo(0, 0)", lang)
            for sid in ("first", *sections):
                if sid != "first":
                    driver.execute_script("document.getElementById(arguments[0]).scrollIntoView({block: 'start'})", sid)
                shot = page.with_name(f"{page.stem}-screen-{lang}-{sid}.png")
                driver.save_screenshot(str(shot))
                out.append(shot)
    return out


def cli(args) -> int:
    """`nexttoken screenshot [PAGE] [--out PNG]`: the explorer's picture (the whole page), beside it by default,
    and its 1280 x 720 screens (`screens`)."""
    page = Path(args.page)
    out = Path(args.out) if args.out else page.with_suffix(".png")
    print(shoot(page, out))
    for shot in screens(page):
        print(shot)
    return 0
