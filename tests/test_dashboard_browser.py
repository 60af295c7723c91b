"""The dashboard in a real headless browser (Debian's chromium + chromedriver, driven by selenium).

The browser gets no network beyond 127.0.0.1 (every host name resolves to nothing), so the page
must work offline. Screenshots go to $CLAWBRIDGE_ARTIFACTS_DIR (default: the test's tmp dir).
Install the browser with `.ci/install_chromium.sh` (apt: chromium chromium-driver).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.dashboard_support import ANSWER, TrainedProxy, screenshots_dir, start_trained_proxy, wait_for

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e '.[dev]')")
from selenium.common.exceptions import WebDriverException  # noqa: E402
from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None or DRIVER is None,
    reason="needs Debian's chromium and chromium-driver (run .ci/install_chromium.sh)",
)


@pytest.fixture(scope="module")
def trained(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TrainedProxy]:
    t = start_trained_proxy(tiny_model_dir, tmp_path_factory.mktemp("dash-browser-state"))
    try:
        yield t
    finally:
        t.proxy.stop()


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return screenshots_dir(tmp_path_factory, "dashboard")


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[WebDriver]:
    opts = Options()
    opts.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1800", f"--user-data-dir={tmp_path / 'profile'}",
                # no network: every name resolves to nothing, only 127.0.0.1 is reachable
                "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
                "--no-first-run", "--disable-background-networking", "--disable-component-update"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(options=opts, service=Service(executable_path=str(DRIVER)))
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def wait_js(driver: WebDriver, script: str, what: str, timeout_s: float = 60.0) -> Any:
    """Poll `script` until it returns something truthy (a page still navigating counts as not yet)."""

    def check() -> Any:
        try:
            return driver.execute_script(script)
        except WebDriverException:
            return None

    return wait_for(check, timeout_s, what)


def log_in(driver: WebDriver, base: str, key: str) -> None:
    driver.get(base + "/dashboard")
    driver.find_element(By.ID, "key").send_keys(key)
    driver.find_element(By.ID, "login").click()


def test_overview_loads_offline_with_reward_points_and_version_lines(
    browser: WebDriver, trained: TrainedProxy, artifacts: Path
) -> None:
    log_in(browser, trained.base, trained.admin)
    wait_js(browser, "return document.body.dataset.loaded === '1'", "the overview to load")
    points = wait_js(browser, "return document.querySelectorAll('#reward-chart circle.pt').length",
                     "reward points")
    assert points == 4  # four api rewards
    assert browser.execute_script("return document.querySelectorAll('#reward-chart line.vline').length") == 2
    assert browser.execute_script("return document.querySelectorAll('#version-chart circle.pt').length") == 2
    assert browser.execute_script("return document.querySelectorAll('#loss-chart circle.pt').length") > 0
    rows = browser.find_elements(By.CSS_SELECTOR, "#sessions tbody tr")
    assert [r.find_element(By.TAG_NAME, "a").text for r in rows] == ["dash-3", "dash-2", "dash-1", "dash-0"]
    assert "0 of 2 samples ready" in browser.find_element(By.ID, "waiting").text  # all trained
    # everything the page loaded came from this server: nothing from a CDN
    resources = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert resources and all(str(u).startswith(trained.base) for u in resources), resources
    # the session cookie is invisible to scripts (HttpOnly)
    assert browser.execute_script("return document.cookie") == ""
    browser.save_screenshot(str(artifacts / "overview.png"))


def test_session_page_shows_the_turn_and_a_reward_set_there_reaches_the_store(
    browser: WebDriver, trained: TrainedProxy, artifacts: Path
) -> None:
    log_in(browser, trained.base, trained.admin)
    wait_js(browser, "return document.body.dataset.loaded === '1'", "the overview to load")
    browser.find_element(By.LINK_TEXT, "dash-1").click()
    wait_js(browser, "return document.querySelectorAll('section.turn').length === 1", "the turn to show")
    turn = browser.find_element(By.CSS_SELECTOR, "section.turn")
    assert ANSWER in turn.find_element(By.CSS_SELECTOR, ".msg.answer").text
    turn.find_element(By.TAG_NAME, "summary").click()
    assert trained.questions["dash-1"] in turn.text
    assert "policy v0" in turn.text and "api 1" in turn.text
    box = turn.find_element(By.CSS_SELECTOR, "input.reward-input")
    box.clear()
    box.send_keys("-0.75")
    turn.find_element(By.CSS_SELECTOR, "button.reward-button").click()
    turn_id = turn.get_attribute("data-turn-id")
    store = trained.proxy.state.store
    wait_for(lambda: any(r.source == "dashboard" and r.value == -0.75 and r.turn_id == turn_id
                         for r in store.session_rewards("dash-1")), what="the reward set in the page")
    wait_js(browser, "return document.body.innerText.includes('dashboard -0.75')", "the page to show it")
    browser.save_screenshot(str(artifacts / "session.png"))


def test_wrong_or_missing_key_sees_no_data(browser: WebDriver, trained: TrainedProxy, artifacts: Path) -> None:
    browser.get(trained.base + "/dashboard")
    assert browser.find_elements(By.ID, "key") and "dash-0" not in browser.page_source
    log_in(browser, trained.base, "not-the-admin-key")
    # the login posts and the page comes back with the error: wait for it (a loaded machine is slow to render)
    wait_js(browser, "const e = document.getElementById('login-error'); "
                     "return !!e && e.innerText.includes('not the admin key')", "the login error")
    assert "dash-" not in browser.page_source
    status = browser.execute_script(
        "const r = await fetch('/dashboard/api/overview'); return r.status;")
    assert status == 401
    browser.get(trained.base + "/dashboard/sessions/dash-1")
    assert browser.find_elements(By.ID, "key") and trained.questions["dash-1"] not in browser.page_source
    browser.save_screenshot(str(artifacts / "login-refused.png"))
