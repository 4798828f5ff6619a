"""The README and docs/ hold together: every relative link and ``#anchor`` resolves, and the generated
reference is what the code says today."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^(```|~~~).*?^\1\s*$", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"(`+).*?\1", re.DOTALL)
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def _prose(text: str) -> str:
    """``text`` without fenced blocks and code spans: links there are examples, not links."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lowercase, punctuation stripped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.replace("`", "").lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor ``page`` defines; a repeated heading gets ``-1``, ``-2``... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for heading in _HEADING.findall(_FENCE.sub("", page.read_text())):
        base = anchor(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path) -> list[str]:
    return [t for t in _LINK.findall(_prose(page.read_text())) if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page):
    broken = []
    for target in links(page):
        path, _, frag = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif frag and (dest.suffix != ".md" or frag not in anchors(dest)):
            broken.append(f"{target}: no heading #{frag} in {dest.name}")
    assert broken == [], broken


def test_the_link_check_can_fail(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A `page`: here\n\n[ok](#a-page-here) [bad](#nowhere) [gone](missing.md) "
                    "[web](https://example.com) `[code](nothing.md)`\n")
    assert links(page) == ["#a-page-here", "#nowhere", "missing.md"]
    assert anchors(page) == {"a-page-here"}


def test_github_anchors():
    assert anchor("Many ranks: one report per job-step, and collector shards") == \
        "many-ranks-one-report-per-job-step-and-collector-shards"
    assert anchor("Without a collector: `nanwatch status --file`") == "without-a-collector-nanwatch-status---file"
    assert anchor("Words") == "words"


def test_the_reference_is_generated_from_the_code():
    """docs/reference.md is rendered from MonitorConfig, Settings and the metric table: a field, setting or
    metric changed without running ``python docs/generate.py`` fails here."""
    result = subprocess.run([sys.executable, str(ROOT / "docs" / "generate.py"), "--check"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_reference_lists_every_option_setting_and_metric():
    sys.path.insert(0, str(ROOT / "docs"))
    import generate

    text = (ROOT / "docs" / "reference.md").read_text()
    from nanwatch.hooks.config import FLAT_OPTIONS, SECTIONS
    from nanwatch.monitor.read.metric_names import METRICS

    rows = generate.config_rows()
    assert {section for section, *_ in rows} == {"", *SECTIONS}  # every section has its table
    assert len(rows) == len(FLAT_OPTIONS) + 1  # every option, and the one filled-in field (collectors)
    for _, flat, path, *_ in rows:
        assert path == "collectors" or FLAT_OPTIONS[flat] == path, path
        assert f"| {f'`{flat}`' if flat else '—'} | `{path}` |" in text, path
    assert all(doc for *_, doc in rows), "a config field without a docstring"
    for metric in METRICS:
        assert f"| `{metric}` |" in text, metric
    assert "| `NANWATCH_MAX_BODY_BYTES` |" in text


def test_the_glossary_names_every_incident_class_and_every_report_kind():
    from typing import get_args

    from nanwatch.wire import IncidentClass, ReportScope

    text = (ROOT / "docs" / "glossary.md").read_text()
    for cls in get_args(IncidentClass):
        assert f"| `{cls}` |" in text, f"the glossary's incident classes miss {cls}"
    for word in ("| step report |", "| job report |", "| heartbeat |", "| final report |"):
        assert word in text, word
    for scope in get_args(ReportScope):
        assert f"`{scope}`" in text, f"the glossary does not name the report scope {scope}"
