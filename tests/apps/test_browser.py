"""End to end: `streamlit run` the explorer on 127.0.0.1 and read it in headless Chromium.

Uses Debian's ``chromium`` package driven by the ``playwright`` Python package through
``executable_path`` (no browser download). Set ``MESHPLAN_APP_SCREENSHOT=docs/app.png`` to
also write the screenshot the README shows.
"""

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
APP = ROOT / "apps" / "streamlit_app.py"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
START_TIMEOUT_S = 40

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("playwright") is None,
                       reason="the playwright package is not installed (pip install "
                       "playwright; it drives Debian's chromium, no browser download)"),
    pytest.mark.skipif(not Path(CHROMIUM).is_file(),
                       reason="Chromium is not installed (apt-get install -y chromium)"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"streamlit exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200 and resp.read().strip() == b"ok":
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"{url} not healthy after {START_TIMEOUT_S} s")


@pytest.fixture
def app_url(tmp_path):
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    log = open(tmp_path / "streamlit.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamlit", "run", str(APP), "--server.headless", "true",
         "--server.address", "127.0.0.1", "--server.port", str(port),
         "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none",
         "--client.toolbarMode", "minimal"],
        cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_healthy(f"http://127.0.0.1:{port}/_stcore/health", proc)
        yield f"http://127.0.0.1:{port}/"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_plan_table_in_chromium(app_url, tmp_path):
    from playwright import sync_api

    from planner.presets import load_model
    from planner.search import search
    from simulator.network.cluster import load_cluster
    best = search(load_model("llama3-8b"), load_cluster("dgx-h100", nodes=2), global_batch=64,
                  top_k=20, micro_batches=(1, 2, 4, 8)).best

    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS,
                                     headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 860})
            page.goto(app_url, timeout=30_000)
            first_row = page.locator('[data-testid="stTable"] tbody tr').first
            first_row.wait_for(timeout=45_000)
            page.get_by_text("candidates searched").wait_for(timeout=15_000)
            page.wait_for_timeout(1500)  # let the charts finish drawing
            shot = tmp_path / "app.png"
            page.screenshot(path=str(shot))
            row_text = first_row.inner_text()
            errors = page.locator('[data-testid="stException"]').count()
        finally:
            browser.close()
    assert shot.stat().st_size > 10_000
    assert errors == 0
    cells = row_text.split("\t")
    assert cells[0].strip() == best.id, row_text
    assert cells[1].strip() == f"{best.tp} × {best.pp} × {best.dp}"
    target = os.environ.get("MESHPLAN_APP_SCREENSHOT")
    if target:
        shutil.copyfile(shot, ROOT / target if not Path(target).is_absolute() else target)
