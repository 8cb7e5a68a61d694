"""The dashboard in a real browser: `rankwatch dashboard --db` served on loopback, each page
loaded by headless Chromium (Debian's, through Selenium and chromedriver), its key elements
found, its charts drawn, and a screenshot kept as a test artifact: under $RANKWATCH_SCREENSHOTS
when set (CI uploads that folder), else under the session's pytest tmp dir (screenshots0/)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.support import loopback
from tests.support.collectors import free_port
from tests.support.dashboard_store import ENDED, FAILED, FLEET, FLIGHT, HANG, IMPORTED, LOADER, NAN

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1400,2200",
)
# page path, run, text the page must show, charts it must draw (page_loads): two pages that a test of its own
# loads and goes on with,
POWER = ("power", FLEET["run"], "No power cap to apply", 4)
COMPARE = ("compare", NAN["run"], f"Compare {NAN['run']} with", 3)
# and the pages test_page_loads_in_a_browser loads for this alone
PAGES = [
    ("", FLEET["run"], f"Ranks {FLEET['straggler']}, {FLEET['thermal']} compute", 1),
    ("stragglers", FLEET["run"], f"Suspects: ranks {FLEET['straggler']}, {FLEET['thermal']}, pattern rank", 2),
    ("ranks", FLEET["run"], "nodes, slowest first", 0),
    ("collectives", FLEET["run"], "Bus bandwidth by collective and size", 2),
    ("checkpoints", NAN["run"], f"the job restored step {NAN['restored']}", 2),
    ("hangs", HANG["run"], f"Culprits: rank {HANG['rank']}", 0),
    ("", HANG["run"], f"which rank {HANG['rank']} never entered", 1),
    ("hangs", FLIGHT["run"], f"Hung when the trace was taken. Culprits: rank {FLIGHT['culprit']}", 0),
    ("sql", FLEET["run"], "Download CSV", 0),
    ("", IMPORTED["run"], "slowdown 1.06x, pattern worker (rank 1)", 0),  # an imported profiler trace
    ("", ENDED["run"], "stragglers / rank", 1),  # a run that ended with a straggler to its end
    ("stragglers", LOADER["run"], "Rank 1 loses the time in input wait (data loading)", 3),  # a slow data loader
    ("", FAILED["run"], f"Failed. Rank {FAILED['rank']} killed", 0),  # a rank the OOM killer killed
]

pytestmark = pytest.mark.skipif(
    not (CHROMIUM.exists() and CHROMEDRIVER.exists()),
    reason="needs Debian's chromium and chromium-driver (make test installs them as root)",
)


@pytest.fixture(scope="module")
def dashboard(dashboard_store, tmp_path_factory):
    """`rankwatch dashboard --db` on a free loopback port, until the module ends."""
    port = free_port()
    log = open(tmp_path_factory.mktemp("dashboard-server") / "dashboard.log", "w")  # noqa: SIM115 - closed at teardown
    process = subprocess.Popen(
        [sys.executable, "-m", "rankwatch", "dashboard", "--db", str(dashboard_store), "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert process.poll() is None, "the dashboard exited"
        try:
            if loopback.get(f"{url}/_stcore/health", timeout=2).text == "ok":
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the dashboard did not start"
        time.sleep(0.5)
    yield url
    process.terminate()
    process.wait(timeout=30)
    log.close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory) -> Path:
    """One folder with every page's screenshot, for a person to look at."""
    if os.environ.get("RANKWATCH_SCREENSHOTS"):
        folder = Path(os.environ["RANKWATCH_SCREENSHOTS"])
        folder.mkdir(parents=True, exist_ok=True)
        return folder
    return tmp_path_factory.mktemp("screenshots")


def wait_shown(browser, texts: tuple[str, ...], where: str = "body") -> None:
    """Wait, a minute at most, until the element `where` (a CSS selector) shows each of `texts` as WebDriver reads
    its text (what a person sees). That reading is a script walking the page's elements, tenths of a second of the
    renderer's CPU a time on these pages, so it is done only once the browser's own innerText holds them all."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    def drawn(inner: str) -> bool:
        flat = " ".join(inner.split())
        return all(" ".join(text.split()) in flat for text in texts)

    inner = "return document.querySelector(arguments[0])?.innerText ?? ''"
    WebDriverWait(browser, 60, poll_frequency=0.5).until(
        lambda b: (
            drawn(b.execute_script(inner, where))
            and all(text in b.find_element(By.CSS_SELECTOR, where).text for text in texts)
        )
    )


def page_loads(browser, dashboard: str, screenshots: Path, path: str, run: str, text: str, charts: int) -> None:
    """The page `path` of `run`, opened by its link: it shows `text`, draws `charts` charts at least and no
    exception, says it reads the store, and its screenshot is kept."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(f"{dashboard}/{path}?run={run}")
    wait_shown(browser, (text,))
    # charts drawn: Vega-Lite puts a canvas (or svg) in each chart's container
    WebDriverWait(browser, 60, poll_frequency=0.5).until(
        lambda b: (
            len(
                b.find_elements(
                    By.CSS_SELECTOR, "[data-testid='stVegaLiteChart'] canvas, [data-testid='stVegaLiteChart'] svg.marks"
                )
            )
            >= charts
        )
    )
    assert not browser.find_elements(By.CSS_SELECTOR, "[data-testid='stException']")
    assert "reading store" in browser.find_element(By.CSS_SELECTOR, "[data-testid='stSidebar']").text
    shot = screenshots / f"{path or 'overview'}-{run}.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000


@pytest.mark.parametrize("path, run, text, charts", PAGES, ids=[f"{p[0] or 'overview'}-{p[1]}" for p in PAGES])
def test_page_loads_in_a_browser(dashboard, browser, screenshots, path, run, text, charts):
    page_loads(browser, dashboard, screenshots, path, run, text, charts)


def test_an_alert_link_lands_on_its_finding(dashboard, browser, dashboard_store, screenshots):
    """An alert's link (collector/alerts/rules.py) opens the Stragglers page of its run with the
    finding first and its evidence open."""
    import duckdb
    from selenium.webdriver.common.by import By

    from collector.alerts import rules

    with duckdb.connect(str(dashboard_store), read_only=True) as con:
        (finding_id,) = con.execute(
            "SELECT id FROM findings WHERE run_id = ? AND analyzer = 'stragglers'", [FLEET["run"]]
        ).fetchone()
    browser.get(rules.dashboard_link(dashboard, FLEET["run"], "stragglers", finding_id))
    # the finding, its evidence (rendered only while its expander is open) and the page under it;
    # Streamlit draws them one after another, so wait for all three
    wait_shown(browser, ("The finding the link is about:", "What to do:", "Suspects:"))
    body = browser.find_element(By.TAG_NAME, "body").text
    assert body.index("The finding the link is about:") < body.index("What to do:")  # evidence shown, open
    assert f"Suspects: ranks {FLEET['straggler']}, {FLEET['thermal']}, pattern rank" in body  # the page itself
    assert browser.save_screenshot(str(screenshots / "alert-link.png"))


def test_power_page_leads_with_why_a_stored_run_gets_no_cap(dashboard, browser, screenshots):
    """In the browser, a run read from a store no collector writes says first why no cap can be
    applied, then what the power analyzer found, and the simulator's GPUs are labelled simulated (after
    what every page shows, page_loads)."""
    from selenium.webdriver.common.by import By

    page_loads(browser, dashboard, screenshots, *POWER)
    drawn = (
        "No power cap to apply: no collector is writing this store.",
        "cap every GPU at",
        "Simulated GPUs",
        "Last power · simulated",
        "Clocks held back on rank",
    )
    wait_shown(browser, drawn)
    body = browser.find_element(By.TAG_NAME, "body").text
    order = [body.index(text) for text in drawn]
    assert order[:2] == sorted(order[:2]) and order[1] < min(order[2:])
    assert "rankwatch power apply" not in body
    assert browser.save_screenshot(str(screenshots / "power-recommendation.png"))


def test_every_chart_exports_its_data_and_its_picture(dashboard, browser, screenshots):
    """A chart's toolbar (Streamlit's) downloads it as PNG and shows the rows it draws, as a table
    that downloads as CSV (on a page that first shows what every page does, page_loads)."""
    from selenium.common.exceptions import (
        ElementClickInterceptedException,
        ElementNotInteractableException,
        StaleElementReferenceException,
    )
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    page_loads(browser, dashboard, screenshots, *COMPARE)  # its charts drawn: the page has settled
    page = WebDriverWait(browser, 60, poll_frequency=0.5)

    def show_data(b) -> bool:
        """Hover the first chart and press its toolbar's "Show data", as a person would; a chart
        still moving when pressed (the page's layout settling) is hovered and pressed again."""
        chart = b.find_elements(By.CSS_SELECTOR, "[data-testid='stVegaLiteChart']")[0]
        ActionChains(b).move_to_element(chart).perform()
        for label in ("Download as PNG", "Show data"):
            if not b.find_elements(By.CSS_SELECTOR, f"button[aria-label='{label}']"):
                return False
        b.find_element(By.CSS_SELECTOR, "button[aria-label='Show data']").click()
        return True

    WebDriverWait(
        browser,
        60,
        poll_frequency=0.5,
        ignored_exceptions=(
            ElementClickInterceptedException,
            ElementNotInteractableException,
            StaleElementReferenceException,
        ),
    ).until(show_data)
    table = page.until(lambda b: b.find_elements(By.CSS_SELECTOR, "[data-testid='stDataFrame']"))[0]
    ActionChains(browser).move_to_element(table).perform()
    page.until(lambda b: b.find_elements(By.CSS_SELECTOR, "button[aria-label='Download as CSV']"))
    assert browser.save_screenshot(str(screenshots / "chart-data.png"))


def test_the_overview_first_screen_says_in_words_what_is_wrong_and_what_to_do(dashboard, browser, screenshots):
    """The Overview of a 2-rank job whose rank 1 waits for its input from step 10, read as a person reads it:
    its first screen (above the step-time chart) names the rank, the phase, the onset and what the others
    wait, then data-loader advice; no analyzer or finding names, ids or JSON there."""
    from selenium.webdriver.common.by import By

    browser.get(f"{dashboard}/?run={LOADER['run']}")
    main = "[data-testid='stMain']"
    wait_shown(browser, ("What to do:", "Step time over the run"), main)
    text = browser.find_element(By.CSS_SELECTOR, main).text
    first_screen = text[: text.index("Step time over the run")]
    said = (
        f"Rank {LOADER['slow']} waits",
        f"for input (data loading) since step {LOADER['from']}; the others wait for it: ",
        "What to do: The slow ranks wait for their input: give their DataLoader more workers",
    )
    for words in said:
        assert words in first_screen, first_screen
    for internal in ("stragglers /", " / rank", "finding ", "{", "evidence of"):
        assert internal not in first_screen, first_screen
    alerts = browser.find_elements(By.CSS_SELECTOR, "[data-testid='stAlert']")
    (verdict,) = [alert for alert in alerts if "What to do" in alert.text]
    assert verdict.location["y"] < browser.get_window_size()["height"] / 2  # on the first screen, near its top
    assert browser.save_screenshot(str(screenshots / "overview-slow-data-loader.png"))
