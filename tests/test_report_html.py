"""`aegis report`: one self-contained HTML page of a run, read as text and as Chromium renders it."""

from __future__ import annotations

import hashlib
import html
import os
import re
import shutil
import sqlite3
import subprocess
import warnings
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
from tests.helpers import guard_config, small_workload, train
from typer.testing import CliRunner

import aegis_sdc as aegis
from aegis_sdc.cli import app
from aegis_sdc.report.html import write_report
from aegis_sdc.store.sqlite import Store, StoreError, rank_db_path

# A high bit of one wgrad's accumulator at step 6, past the shortened calibration: confirmed by replay.
FAULT_STEP = 6
FAULT = aegis.FaultSpec(site="layers.0.attn.wo:wgrad", model="bitflip", bit=29, steps=(FAULT_STEP,), seed=2)
QUICK = aegis.ThresholdConfig(calibration_checks=4)  # the default 16 would cost 12 more steps
HOSTILE = r'<script>alert("x")</script>[/x] $\frac{$ & <b>bold</b>'  # markup, Rich markup and math mode
SHOT_SIZE = (1280, 2400)

runner = CliRunner()


def protected_run(root: Path, steps: int, **config):
    """A small Llama trained on the CPU with every Linear protected; returns the guard (closed)."""
    model, data, optimizer = small_workload()
    guard = aegis.protect(model, optimizer=optimizer, config=guard_config(root, **config))
    with warnings.catch_warnings():  # the warn policy's warnings: the tests read the store instead
        warnings.simplefilter("ignore", aegis.SilentDataCorruptionWarning)
        try:
            train(model, data, optimizer, steps)
        finally:
            guard.close()
    return guard


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    """(run directory, its confirmed incidents as (site, step, rank)) of a run with one injected fault."""
    root = tmp_path_factory.mktemp("faulty")
    guard = protected_run(root, steps=FAULT_STEP + 1, faults=(FAULT,), thresholds=QUICK)
    incidents = [(i.site.name, i.step, i.identity.rank) for i in guard.incidents]
    assert incidents and {(site, step) for site, step, _ in incidents} == {(FAULT.site, FAULT_STEP)}
    return root / "run", incidents


@pytest.fixture(scope="module")
def faulty_page(faulty, tmp_path_factory) -> tuple[Path, str, str]:
    """(the page's path, its text, the store's SHA-256 before the page was written)."""
    before = sha256(rank_db_path(faulty[0], 0))
    out = write_report(faulty[0], tmp_path_factory.mktemp("page") / "report.html")
    return out, out.read_text(encoding="utf-8"), before


def section(page: str, name: str) -> str:
    match = re.search(rf'<section id="{name}">(.*?)</section>', page, flags=re.S)
    assert match, f"no {name} section"
    return match.group(1)


def table_rows(fragment: str) -> list[str]:
    return re.findall(r"<tr[^>]*>(.*?)</tr>", fragment, flags=re.S)


def cells(row: str) -> list[str]:
    """The text of a row's data cells, tags dropped and white space collapsed."""
    return [
        html.unescape(" ".join(re.sub(r"<[^>]+>", " ", c).split()))
        for c in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)
    ]


def incident_rows(page: str) -> list[list[str]]:
    """The confirmed-incidents table: id, step, rank, device, site, channel, value, threshold, verdict, tiles."""
    table = section(page, "incidents").split("Injected faults", 1)[0]
    return [row for r in table_rows(table) if (row := cells(r))]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_page_lists_each_confirmed_incident_with_its_site_step_and_verdict(faulty, faulty_page):
    _, incidents = faulty
    page = faulty_page[1]
    listed = sorted((row[4], int(row[1]), int(row[2])) for row in incident_rows(page))
    assert all(row[8].startswith("confirmed_sdc original") for row in incident_rows(page))
    assert listed == sorted(incidents)
    assert f"{len(incidents)} confirmed silent data corruption incident(s)" in section(page, "summary")
    # the injected fault's ground truth is shown as confirmed
    (injected,) = [c for r in table_rows(section(page, "incidents").split("Injected faults", 1)[1]) if (c := cells(r))]
    assert injected[:3] == [str(FAULT_STEP), "0", FAULT.site] and injected[-1] == "yes"
    # the faulty site tops the table of sites, over its threshold, at the fault's step
    first_site = cells(table_rows(section(page, "sites"))[1])
    assert first_site[0] == FAULT.site and first_site[10] == str(FAULT_STEP) and first_site[-1] == str(len(incidents))


def test_the_page_is_self_contained(faulty_page):
    page = faulty_page[1]
    targets = re.findall(r"""(?:src|href)\s*=\s*["']?([^"'\s>]+)""", page)
    assert targets and all(t.startswith(("data:image/png;base64,", "#")) for t in targets), targets
    assert sum(t.startswith("data:") for t in targets) == 3  # timeline, sites, verification latency
    for external in ("http://", "https://", "<script", "<link", "@import", "url("):
        assert external not in page


def test_writing_the_report_changes_no_store(faulty, faulty_page):
    store = rank_db_path(faulty[0], 0)
    assert sha256(store) == faulty_page[2]
    assert sorted(p.name for p in faulty[0].glob("*.sqlite*")) == [store.name]  # no WAL files left behind


def test_a_clean_run_says_no_confirmed_incidents(tmp_path):
    protected_run(tmp_path, steps=4)  # calibrating throughout: loose thresholds, nothing to verify
    page = write_report(tmp_path / "run").read_text(encoding="utf-8")
    incidents = section(page, "incidents")
    assert "No confirmed incidents" in incidents and "<table>" not in incidents
    assert "No verdicts" in section(page, "latency")
    assert 'class="over"' not in section(page, "sites")  # no site over its threshold


def test_hostile_site_names_are_escaped(faulty, tmp_path):
    run_dir = tmp_path / "copy"
    shutil.copytree(faulty[0], run_dir)
    with sqlite3.connect(rank_db_path(run_dir, 0)) as conn:
        assert conn.execute("UPDATE sites SET name = ? WHERE name = ?", (HOSTILE, FAULT.site)).rowcount == 1
    page = write_report(run_dir).read_text(encoding="utf-8")
    assert HOSTILE not in page and "<script" not in page and "<b>bold" not in page
    # as text: the cells read back (tags dropped, entities decoded) give the name unchanged
    assert [row[4] for row in incident_rows(page)] == [HOSTILE]
    assert HOSTILE in [cells(r)[0] for r in table_rows(section(page, "sites")) if cells(r)]


def test_the_stores_of_all_ranks_are_merged(faulty, tmp_path):
    run_dir = tmp_path / "two-ranks"
    shutil.copytree(faulty[0], run_dir)
    shutil.copy(rank_db_path(run_dir, 0), rank_db_path(run_dir, 1))
    with sqlite3.connect(rank_db_path(run_dir, 1)) as conn:
        conn.execute("UPDATE run SET rank = 1, host = 'other-host'")
        conn.execute("UPDATE incidents SET rank = 1, host = 'other-host'")
    page = write_report(run_dir).read_text(encoding="utf-8")
    assert sorted((row[4], int(row[2])) for row in incident_rows(page)) == [(FAULT.site, 0), (FAULT.site, 1)]
    site = next(cells(r) for r in table_rows(section(page, "sites")) if f">{FAULT.site}<" in r)
    assert site[2] == "2"  # ranks
    assert "other-host" in section(page, "run")


def test_an_empty_or_in_progress_run_renders(tmp_path):
    started = Store(rank_db_path(tmp_path, 0))  # still open: a run in progress, no step yet
    started.write_run({"host": "h", "rank": 0, "local_rank": 0, "world_size": 2, "device": "cpu"}, {}, {"torch": "x"})
    opened = Store(rank_db_path(tmp_path, 1))  # created, its run row not yet committed
    try:
        page = write_report(tmp_path).read_text(encoding="utf-8")
    finally:
        started.close()
        opened.close()
    assert "No steps recorded yet" in section(page, "timeline")
    assert "No confirmed incidents (no steps recorded yet)" in section(page, "summary")
    assert section(page, "run").count("in progress") == 2


def test_a_directory_without_a_store_is_refused(tmp_path):
    with pytest.raises(StoreError, match="no aegis store"):
        write_report(tmp_path)


def test_the_cli_writes_the_page_and_prints_its_path(faulty, tmp_path):
    out = tmp_path / "sub" / "page.html"
    result = runner.invoke(app, ["report", str(faulty[0]), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == str(out) and FAULT.site in out.read_text(encoding="utf-8")
    empty = runner.invoke(app, ["report", str(tmp_path / "sub")])
    assert empty.exit_code == 2 and "no aegis store" in empty.output


# -- as a browser renders it ------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def chromium() -> str:
    """Debian's chromium, installed when missing (needs root and apt-get; skipped otherwise)."""
    found = shutil.which("chromium")
    if found:
        return found
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        pytest.skip("chromium is missing and cannot be installed here (needs root and apt-get)")
    env = os.environ | {"DEBIAN_FRONTEND": "noninteractive"}
    try:
        subprocess.run("apt-get update -qq && apt-get install -y -qq chromium", shell=True, env=env,
                       check=True, capture_output=True, text=True, timeout=600)  # fmt: skip
    except subprocess.CalledProcessError as error:
        pytest.skip(f"installing chromium failed: {error.stderr[-500:]}")
    except (subprocess.TimeoutExpired, OSError) as error:
        pytest.skip(f"installing chromium failed: {error}")
    found = shutil.which("chromium")
    if found is None:
        pytest.skip("chromium installed but not on PATH")
    return found


def test_chromium_renders_the_page(chromium, faulty_page, tmp_path):
    out = faulty_page[0]
    shot = tmp_path / "shot.png"
    width, height = SHOT_SIZE
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}", f"--window-size={width},{height}"]  # fmt: skip
    # one browser: the screenshot, and the DOM as parsed on stdout
    browser = subprocess.run([chromium, *flags, f"--screenshot={shot}", "--dump-dom", out.as_uri()],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert browser.returncode == 0, browser.stderr[-2000:]

    dom = browser.stdout
    assert f">{FAULT.site}<" in dom and "confirmed_sdc" in dom
    assert dom.count('<img class="plot"') == 3

    pixels = matplotlib.image.imread(shot)[..., :3]  # PNG: floats in [0, 1]
    assert pixels.shape == (height, width, 3)
    assert pixels.std() > 0.1
    rgb = np.round(pixels * 255).astype(np.int64) @ np.array([1 << 16, 1 << 8, 1])  # one integer per color
    counts = np.bincount(rgb.ravel())
    background = counts.max() / rgb.size
    assert background < 0.8 and np.count_nonzero(counts) > 100  # text, tables and plots: not a blank page
