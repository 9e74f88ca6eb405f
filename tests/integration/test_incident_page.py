"""The incident page and /docs in real headless Chromium (Debian's `chromium`), served by
uvicorn on loopback over the real ClickHouse engine (chDB) holding the sample data set.

The screenshot is decoded here (a small PNG reader: zlib and numpy, no imaging library) and
checked for what a person would look for: the step-time line, the onset line across the
chart, and the slow rank's heatmap row dark from the onset on. Chromium runs with name
resolution off for everything but loopback, and its network log must show no request of the
page going anywhere but the app.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import zlib
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote, urlsplit

import httpx
import msgspec
import numpy as np
import pytest

from api.app import create_app
from api.page.svg import HEAT_HIGH, ONSET_COLOUR, STEP_COLOUR
from schemas.wire import StackGroup
from storage.client import connect
from storage.migrations import apply_schema
from storage.testing import SAMPLE_JOB, load_sample, make_incident
from storage.writer import Sink
from tests.live_api import served

CHROMIUM = shutil.which("chromium")
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(CHROMIUM is None, reason="chromium (Debian's chromium) is not installed"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

GPU_INCIDENT = f"{SAMPLE_JOB}/gpu/rank:1/30"  # load_sample: rank 1 slow from step 30
HANG_JOB = "team/hung"
HANG_FRAME = "train.py:88 in step <all_reduce & wait>"
# Background calls of the browser itself off, and no name resolves but loopback: nothing the
# browser does leaves the machine, and a page that needed the outside would show it.
QUIET = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-default-apps", "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"]


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    db = connect(f"chdb://{tmp_path_factory.mktemp('chdb')}?database=test_page")
    apply_schema(db)
    sink = Sink(db)
    load_sample(sink)
    hang = make_incident(HANG_JOB, culprit="rank:2", kind="hang", onset_step=3,
                         opened_step=4, last_step=4)
    hang = msgspec.structs.replace(hang, stacks=[
        StackGroup(thread="training", frames=["train.py:10 in main", HANG_FRAME],
                   ranks="2", n_ranks=1, not_ranks="0-1,3"),
        StackGroup(thread="training", frames=[], ranks="0-1,3", n_ranks=3, not_ranks="2",
                   note="no answer"),
    ])
    sink.add_incident(hang)
    sink.flush()
    with served(create_app(db)) as url:
        yield url
    db.close()


def chromium(*args: str) -> str:
    assert CHROMIUM is not None
    done = subprocess.run([CHROMIUM, *QUIET, *args], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def page_requests(net_log: Path, base_url: str) -> list[str]:
    """The URLs Chromium requested for the pages of `base_url`'s site, from its network log:
    the requests whose network isolation key is that site are the ones made on behalf of
    its pages (the browser's own have another key)."""
    site = "{0.scheme}://{0.hostname}".format(urlsplit(base_url))
    log = json.loads(net_log.read_text())
    start = log["constants"]["logEventTypes"]["URL_REQUEST_START_JOB"]
    params = [e.get("params", {}) for e in log["events"] if e["type"] == start]
    return [p["url"] for p in params
            if p.get("network_isolation_key", "").split(" ")[0] == site]


# -- a PNG reader, enough for Chromium's screenshots --------------------------------------


def _unfilter_slow(kind: int, row: bytes, prev: bytes, bpp: int) -> bytes:
    """PNG filters 3 (average) and 4 (Paeth): each byte depends on the one to its left."""
    out = bytearray(row)
    for i in range(len(out)):
        a = out[i - bpp] if i >= bpp else 0
        b = prev[i]
        if kind == 3:
            out[i] = (out[i] + (a + b) // 2) & 0xFF
            continue
        c = prev[i - bpp] if i >= bpp else 0
        p = a + b - c
        pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
        out[i] = (out[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
    return bytes(out)


def read_png(path: Path) -> np.ndarray:
    """An 8-bit RGB or RGBA, non-interlaced PNG as an (h, w, 3) uint8 array."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", (0, 0, 0, 0, 0, 0, 0)
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    width, height, depth, colour, _, _, interlace = header
    assert depth == 8 and colour in (2, 6) and interlace == 0, header
    bpp = 3 if colour == 2 else 4
    raw = zlib.decompress(idat)
    stride = width * bpp
    rows = np.zeros((height, stride), np.uint8)
    prev = np.zeros(stride, np.uint8)
    for y in range(height):
        kind = raw[y * (stride + 1)]
        line = np.frombuffer(raw, np.uint8, stride, y * (stride + 1) + 1)
        if kind == 0:
            cur = line.copy()
        elif kind == 1:
            cur = np.cumsum(line.reshape(-1, bpp), axis=0, dtype=np.uint8).reshape(-1)
        elif kind == 2:
            cur = line + prev
        else:
            cur = np.frombuffer(_unfilter_slow(kind, line.tobytes(), prev.tobytes(), bpp),
                                np.uint8)
        rows[y] = prev = cur
    return rows.reshape(height, width, bpp)[:, :, :3]


def near(img: np.ndarray, hex_colour: str | tuple[int, int, int], tol: int = 40) -> np.ndarray:
    """Mask of the pixels within `tol` of a colour on every channel."""
    rgb = (tuple(int(hex_colour[i:i + 2], 16) for i in (1, 3, 5))
           if isinstance(hex_colour, str) else hex_colour)
    return np.all(np.abs(img.astype(np.int16) - np.array(rgb, np.int16)) <= tol, axis=2)


# -- the tests ----------------------------------------------------------------------------


def test_a_screenshot_shows_step_time_the_onset_and_the_slow_rank(
        base_url: str, tmp_path: Path) -> None:
    shot = tmp_path / "incident.png"
    chromium(f"--screenshot={shot}", "--window-size=1200,1600",
             f"{base_url}/incidents/{quote(GPU_INCIDENT, safe='/:')}")
    img = read_png(shot)
    assert img.shape == (1600, 1200, 3)
    # the step-time polyline: a 2 px line across most of the chart's width
    blue = near(img, STEP_COLOUR, tol=16)
    assert blue.sum() > 800, blue.sum()
    line_rows = np.nonzero(blue.sum(axis=1) > 100)[0]  # its flat stretches (not link text)
    assert len(line_rows) >= 2
    xs = np.nonzero(blue[line_rows].any(axis=0))[0]
    assert xs.max() - xs.min() > 600
    # the onset: one red line down the chart, much taller than any text or badge
    red = near(img, ONSET_COLOUR)
    tallest = red.sum(axis=0)
    onset_x = int(tallest.argmax())
    assert tallest[onset_x] > 150, tallest.max()
    # the heatmap: one rank's row dark from the onset on, in rows of the page below the chart
    dark = near(img, HEAT_HIGH, tol=30)
    row_hits = dark.sum(axis=1)
    slow_rows = np.nonzero(row_hits > 300)[0]
    assert len(slow_rows) >= 8, row_hits.max()  # a row of the heatmap is 18 px tall
    assert slow_rows.min() > line_rows.max()  # below the step-time chart
    first_dark_x = int(np.nonzero(dark[slow_rows].any(axis=0))[0].min())
    assert abs(first_dark_x - onset_x) < 25, (first_dark_x, onset_x)
    # left of the onset, the same rows are light: rank 1 was like its peers before
    assert not dark[slow_rows, : onset_x - 25].any()


def test_the_page_loads_nothing_from_outside_and_shows_a_hangs_stacks(
        base_url: str, tmp_path: Path) -> None:
    hang_id = f"{HANG_JOB}/hang/rank:2/3"
    net = tmp_path / "net.json"
    dom = chromium(f"--log-net-log={net}", "--dump-dom",
                   f"{base_url}/incidents/{quote(hang_id, safe='/:')}")
    assert "Stacks" in dom and "train.py:88 in step &lt;all_reduce &amp; wait&gt;" in dom
    assert dom.index("ranks 2 (1)") < dom.index("ranks 0-1,3 (3)")  # the odd one out first
    assert "no answer" in dom
    urls = page_requests(net, base_url)
    assert urls and {urlsplit(u).netloc for u in urls} == {urlsplit(base_url).netloc}, urls


def test_an_unknown_incident_is_a_404_page(base_url: str) -> None:
    r = httpx.get(f"{base_url}/incidents/no/such/incident", timeout=30)
    assert r.status_code == 404 and r.headers["content-type"].startswith("text/html")
    assert "no incident with id &#x27;no/such/incident&#x27;" in r.text


def test_docs_render_swagger_ui_offline(base_url: str, tmp_path: Path) -> None:
    net = tmp_path / "net.json"
    dom = chromium("--virtual-time-budget=5000", f"--log-net-log={net}", "--dump-dom",
                   f"{base_url}/docs")
    # Swagger UI ran: it read /openapi.json and drew an operation for each route
    assert 'class="swagger-ui"' in dom
    assert 'data-path="/v1/incidents/{incident_id}"' in dom
    urls = page_requests(net, base_url)
    assert f"{base_url}/openapi.json" in urls
    assert {urlsplit(u).netloc for u in urls} == {urlsplit(base_url).netloc}, urls
    served = httpx.get(f"{base_url}/docs", timeout=30).text
    assert "http://" not in served and "https://" not in served  # every asset is the app's
