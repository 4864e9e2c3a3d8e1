"""The HTML run report: well-formed, self-contained, complete where it can be, honest where it cannot.

Run directories are written by hand (the structure of a real ``dtrain run`` of examples/digits), so no
training happens here.
"""

from __future__ import annotations

import base64
import html
import io
import json
import os
import re
import shutil
import signal
import subprocess
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path

import matplotlib.image
import pytest
from profiles import make_profile, make_summary, write

from dtrain.errors import UserError
from dtrain.explain.doctor import diagnose
from dtrain.explain.report import write_report
from dtrain.profiling.record import ProfileRecord, load_run_profile
from dtrain.profiling.runsummary import write_summary

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}
PHASES = ["data", "forward", "backward", "comm_exposed", "optimizer", "other"]

CONFIG = """\
name: {name}
entrypoint: model_def:DigitsTrial
hyperparameters:
  global_batch_size: 64
  lr: 0.1
resources:
  slots_per_trial: 2
optimizations:
  aggregation_frequency: 1
  gradient_compression: none
profiling:
  enabled: true
  warmup_steps: 3
"""


def _ms(values: list[float]) -> dict[str, float]:
    return {p: v / 1e3 for p, v in zip(PHASES, values, strict=True)}


def _profile(host: str = "vm") -> ProfileRecord:
    """A 2-rank profile shaped like the digits example's (rank 1 a little slower)."""
    return make_profile([_ms([0.17, 0.21, 0.33, 0.94, 0.19, 0.03]), _ms([0.16, 0.20, 0.34, 0.95, 0.19, 0.03])],
                        host, comm={"bytes_per_step": 104488.0, "buckets_per_step": 1.0,
                                    "busy_seconds_per_step": 0.000944, "exposed_seconds_per_step": 0.000944,
                                    "algbw_bytes_per_second": 1.107e8, "busbw_bytes_per_second": 1.107e8,
                                    "latency_seconds": 0.000149})


def _records(train_metric: str = "loss") -> list[dict]:
    records = []
    for i in range(1, 7):
        records.append({"kind": "training", "batches": 50 * i, "epoch": 2 * i,
                        "metrics": {train_metric: 1.4 / i}, "samples_per_second": 30000.0 + 500 * i})
        if i % 2 == 0:
            records.append({"kind": "validation", "batches": 55 * i, "epoch": 2 * i,
                            "metrics": {"accuracy": 0.9 + 0.01 * i, "validation_loss": 0.2 / i}})
    records[0]["metrics"][train_metric] = None  # metrics may be null (e.g. not reported on this rank)
    return records


def make_run(path: Path, *, name: str = "digits", profile: ProfileRecord | None = None,
             records: list[dict] | None = None, summary: bool = True) -> Path:
    """A run directory as ``dtrain run`` leaves it; ``profile``/``records`` None means the file is absent."""
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(CONFIG.format(name=json.dumps(name)))
    if records is not None:
        (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if profile is not None:
        write(path, profile)
    if summary:
        write_summary(path / "summary.json", make_summary({"accuracy": 0.9805, "validation_loss": 0.074}))
    return path


class _Structure(HTMLParser):
    """Checks that every non-void tag is closed, in order, and collects the images and section ids."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.images: list[dict[str, str | None]] = []
        self.sections: list[str | None] = []

    def handle_starttag(self, tag, attrs):
        self._collect(tag, attrs)
        if tag not in VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self._collect(tag, attrs)
        if tag not in VOID:
            self.errors.append(f"<{tag} /> is not a void element")

    def handle_endtag(self, tag):
        if tag in VOID:
            self.errors.append(f"</{tag}> closes a void element")
        elif not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> but open: {self.stack[-3:]} at {self.getpos()}")
        else:
            self.stack.pop()

    def _collect(self, tag, attrs):
        if tag == "img":
            self.images.append(dict(attrs))
        if tag == "section":
            self.sections.append(dict(attrs).get("id"))


def check_well_formed(page: str) -> _Structure:
    """Both checks: tag balance under the HTML parser, and a strict XML parse of the same text."""
    parser = _Structure()
    parser.feed(page)
    parser.close()
    assert not parser.errors, parser.errors
    assert not parser.stack, f"unclosed: {parser.stack}"
    root = ET.fromstring(page)  # raises on any mismatched tag, bad entity or stray '&' / '<'
    assert root.tag == "html" and root.find("head/title") is not None and root.find("body") is not None
    return parser


def png_bytes(image: dict[str, str | None]) -> bytes:
    src = image["src"] or ""
    prefix = "data:image/png;base64,"
    assert src.startswith(prefix), src[:40]
    return base64.b64decode(src[len(prefix):], validate=True)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    run_dir = make_run(tmp_path_factory.mktemp("report") / "run", profile=_profile(), records=_records())
    path = write_report(run_dir)
    return run_dir, path, path.read_text(encoding="utf-8")


def test_full_report_is_well_formed_and_has_every_section(full_run):
    run_dir, path, page = full_run
    assert path == run_dir / "report.html"
    structure = check_well_formed(page)
    assert structure.sections == ["doctor", "breakdown", "throughput", "curves", "config"]
    assert len(structure.images) == 3
    assert "This report is incomplete" not in page
    for fact in ("digits", "34,351", "accuracy 0.9805", "<dt>slots</dt><dd>2</dd>"):
        assert fact in page
    assert "gradient_compression: none" in page  # the config, verbatim
    assert "104.49 kB" in page and "110.70 MB/s" in page  # comm figures
    assert re.search(r"<td>comm_exposed</td><td class=\"num\">0\.940</td>", page)  # min/mean/max table


def test_doctor_verdict_and_highlighted_top_factor(full_run):
    run_dir, _, page = full_run
    diagnosis = diagnose(load_run_profile(run_dir)).to_json()
    assert html.escape(diagnosis["verdict"]) in page
    top_rows = re.findall(r'<tr class="top"><td>([^<]*)</td>', page)
    assert top_rows == [diagnosis["top_factor"]]
    for factor in diagnosis["factors"]:
        assert f"<td>{factor['factor']}</td>" in page
        if factor["key"] is not None:
            assert f"<code>{factor['key']}: {factor['value']}</code>" in page


def test_every_image_is_an_embedded_png(full_run):
    _, _, page = full_run
    structure = check_well_formed(page)
    assert structure.images
    for image in structure.images:
        raw = png_bytes(image)
        assert raw.startswith(PNG_SIGNATURE)
        pixels = matplotlib.image.imread(io.BytesIO(raw), format="png")
        assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100
    assert "http://" not in page and "https://" not in page  # nothing to fetch: it opens offline


def test_no_profile_still_renders_with_a_note(tmp_path):
    page = write_report(make_run(tmp_path / "run", profile=None, records=_records(), summary=False)).read_text()
    structure = check_well_formed(page)
    assert "This report is incomplete" in page and "no profile.json yet" in page
    assert "No step profile (profile.json)" in page and "The doctor needs profile.json" in page
    assert len(structure.images) == 2  # throughput and curves remain
    assert "33,000 (last training report)" in page  # samples/s from metrics when the run has no summary
    assert "accuracy 0.96" in page  # last validation record stands in for the final one


def test_missing_and_empty_metrics_still_render(tmp_path):
    for records, note in ((None, "metrics.jsonl is missing"), ([], "metrics.jsonl has no training or validation")):
        run_dir = make_run(tmp_path / f"run-{records is None}", profile=_profile(), records=records, summary=False)
        page = write_report(run_dir).read_text()
        structure = check_well_formed(page)
        assert note in page
        assert "No training records with samples/s" in page and "No training or validation metrics" in page
        assert "<dd>none recorded</dd>" in page  # no final validation metrics anywhere
        assert len(structure.images) == 1  # the breakdown
        assert 'class="verdict"' in page


def test_corrupt_profile_and_partial_metrics_line(tmp_path):
    run_dir = make_run(tmp_path / "run", profile=None, records=_records())
    (run_dir / "profile.json").write_text('{"schema_version": 1, "per_ra')
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write('{"kind": "training", "batc')  # a run killed mid-write
    page = write_report(run_dir).read_text()
    check_well_formed(page)
    assert "profile.json is empty or corrupt" in page
    assert "1 unreadable line(s) skipped" in page


def test_user_strings_are_escaped(tmp_path):
    profile = _profile(host="<i>evil-host</i>")
    run_dir = make_run(tmp_path / "run", name="<script>alert('x')</script> & co", profile=profile,
                       records=_records(train_metric="<b>loss</b> $x^$"))
    page = write_report(run_dir).read_text()
    structure = check_well_formed(page)
    assert "<script" not in page and "<b>" not in page and "<i>" not in page
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt; &amp; co" in page  # title, header and config
    assert page.count("&lt;script&gt;") >= 3
    assert "&lt;i&gt;evil-host&lt;/i&gt;" in page  # the straggler's "why" names the host
    assert len(structure.images) == 3  # a '$' in a metric name does not break matplotlib's text


def test_profile_the_doctor_cannot_model_is_a_note(tmp_path):
    profile = _profile().model_copy(update={"global_batch_size": 0})  # a valid record, not a model the doctor has
    page = write_report(make_run(tmp_path / "run", profile=profile, records=None)).read_text()
    check_well_formed(page)
    assert "The doctor could not diagnose this profile" in page and "Error(" in page
    assert "<td>latency ms (one float)</td><td class=\"num\">0.149</td>" in page  # the breakdown still shows


@pytest.mark.parametrize("broken", [
    "<html><body><p>unclosed</body></html>",
    "<html><body><b><i>crossed</b></i></body></html>",
    "<html><body><div /></body></html>",
    "<html><body><p>a & b</p></body></html>",
])
def test_the_well_formedness_check_is_real(broken):
    with pytest.raises((AssertionError, ET.ParseError)):
        check_well_formed(broken)


def test_not_a_run_directory(tmp_path):
    with pytest.raises(UserError, match="not a directory"):
        write_report(tmp_path / "nope")


def test_the_answer_comes_first_and_the_config_last_folded(full_run):
    _, _, page = full_run
    body = page[page.index("<body>"):]
    verdict = body.index('class="verdict"')
    # Before the verdict: only the title and the run's facts; no chart, table or other section.
    assert "<img" not in body[:verdict] and "<table" not in body[:verdict] and "<pre" not in body[:verdict]
    assert verdict < body.index("<h3>Try first</h3>") < body.index('id="breakdown"') < body.index('id="curves"')
    config = body.index('<section id="config">')
    assert config > body.index('id="curves"') and "<details>" in body[config:] and "<details open" not in body


CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
PROBE = """<script>
const box = document.getElementById("verdict").getBoundingClientRect();
document.body.setAttribute("data-probe", [box.top, box.bottom, window.innerWidth, window.innerHeight].join(" "));
</script>"""


def _chromium(tmp_path, *args: str) -> str:
    """Headless Chromium at 1280 x 800, its own profile folder, killed whole if it hangs."""
    argv = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
            f"--user-data-dir={tmp_path / 'chromium-profile'}", "--window-size=1280,800", *args]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError("chromium did not finish in 90 s") from None
    return out


def _digits_run(path: Path) -> Path:
    """A run directory whose config.yaml is the digits example's, resolved (66 lines, as a real run's)."""
    from dtrain.config.schema import dump_config, load_config

    run_dir = make_run(path, profile=_profile(), records=_records())
    dump_config(load_config(Path(__file__).parents[2] / "examples" / "digits" / "experiment.yaml"),
                run_dir / "config.yaml")
    return run_dir


@pytest.mark.skipif(CHROMIUM is None, reason="needs headless Chromium (Debian: apt-get install chromium)")
def test_verdict_is_on_the_first_screen_in_a_browser(tmp_path):
    path = write_report(_digits_run(tmp_path / "run"))
    page = path.read_text(encoding="utf-8")
    probed = tmp_path / "probed.html"  # the page itself runs no script; a copy measures where the verdict lands
    probed.write_text(page.replace("</body>", PROBE + "</body>"), encoding="utf-8")
    dom = _chromium(tmp_path, "--dump-dom", probed.as_uri())
    found = re.search(r'data-probe="([\d.\s-]+)"', dom)
    assert found is not None, dom[-500:]
    top, bottom, width, height = (float(v) for v in found.group(1).split())
    assert width == 1280 and height >= 600, (width, height)
    assert 0 <= top < bottom <= height, f"verdict at {top:.0f}-{bottom:.0f} px, screen {height:.0f} px tall"
    shot = tmp_path / "first-screen.png"
    _chromium(tmp_path, f"--screenshot={shot}", path.as_uri())
    rgb = (matplotlib.image.imread(shot)[..., :3] * 255).round()  # imread gives floats in [0, 1]
    verdict_border = (rgb == (240, 173, 78)).all(axis=-1)  # .verdict's left border (#f0ad4e): nothing else has it
    assert rgb.shape[1] == 1280 and verdict_border.sum() > 100  # the verdict is on the screenshot's screen
