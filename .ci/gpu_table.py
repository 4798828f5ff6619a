"""The one table ``.ci/gpu-check`` prints: every ``nanwatch bench --device cuda`` run it made, one row each.

``.ci/gpu-check`` runs the step bench once per (dtype, model, attention backend), each with ``--json`` and under
``timeout``, and appends one line per run to a ``runs.jsonl`` manifest: the labels, the exit code and the JSON's
path. ``python .ci/gpu_table.py RUNS.jsonl OUT_DIR`` turns that into ``summary.txt`` (the table, also
printed) and ``summary.json`` (the rows). A run that timed out, failed, was skipped for time, or whose attention
backend has no kernel for the step (``nanwatch bench`` exits 4) is a row saying so, not a gap. Pure: no torch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

__all__ = ["COLUMNS", "format_rows", "main", "row", "rows_from_manifest"]

#: (key, header, width) of each column, in order
COLUMNS = (("device", "device", 22), ("dtype", "dtype", 5), ("model", "model", 6), ("backend", "backend", 9),
           ("bare_ms", "bare ms", 8), ("nanwatch", "nanwatch x", 10), ("nanwatch_guard", "+guard x", 8),
           ("debug_underflow_overflow", "DUO x", 6), ("detect_anomaly", "anomaly x", 9), ("status", "status", 0))
_RATIOS = ("nanwatch", "nanwatch_guard", "debug_underflow_overflow", "detect_anomaly")


def _status(rc: int | None, results: dict | None) -> str:
    if rc == -1:
        return "skipped: the check's time budget was spent"
    if results is not None and "unavailable" in results:
        return "unavailable: " + results["unavailable"]
    if rc in (124, 137):
        return "timed out"
    if rc != 0:
        return f"failed (exit {rc})"
    if results is None:
        return "failed (no JSON written)"
    return "ok"


def row(label: dict, rc: int | None, results: dict | None) -> dict:
    """One table row: ``label`` (dtype, model, backend), the run's exit code (-1: skipped) and its JSON (or None).
    Ratios are the bench's paired ratios to bare (None where that variant did not run)."""
    variants = (results or {}).get("variants") or {}
    device = ((results or {}).get("machine") or {}).get("cuda_device") or label.get("device", "cuda")
    out = {"device": device, "dtype": label["dtype"], "model": label["model"], "backend": label["backend"],
           "status": _status(rc, results), "rc": rc,
           "bare_ms": variants["bare"]["median_ms"] if "bare" in variants else None}
    for name in _RATIOS:
        out[name] = variants[name]["paired_ratio"] if name in variants else None
    return out


def _cell(key: str, value, width: int) -> str:
    if value is None:
        text = "-"
    elif key == "bare_ms":
        text = f"{value:.2f}"
    elif key in _RATIOS:
        text = f"{value:.3f}"
    else:
        text = str(value)
    return text.ljust(width) if width else text


def format_rows(rows: list[dict]) -> str:
    """The table: a header and one line per row; ratios are paired, to bare, at three decimals."""
    head = " ".join(h.ljust(w) if w else h for _, h, w in COLUMNS)
    lines = [head, "-" * len(head)]
    lines += [" ".join(_cell(k, r.get(k), w) for k, _, w in COLUMNS).rstrip() for r in rows]
    if not rows:
        lines.append("(no bench runs)")
    return "\n".join(lines)


def rows_from_manifest(manifest: Path) -> list[dict]:
    """The rows of every run a ``runs.jsonl`` lists (a JSON missing or unreadable reads as None)."""
    rows = []
    for line in manifest.read_text().splitlines():
        if not line.strip():
            continue
        entry = json.loads(line)
        results = None
        path = Path(entry.get("json") or "")
        if entry.get("json") and path.is_file():
            try:
                results = json.loads(path.read_text())
            except ValueError:
                results = None
        rows.append(row(entry, entry.get("rc"), results))
    return rows


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: python .ci/gpu_table.py RUNS.jsonl OUT_DIR")
        return 2
    manifest, out = Path(args[0]), Path(args[1])
    rows = rows_from_manifest(manifest) if manifest.is_file() else []
    table = format_rows(rows)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.txt").write_text(table + "\n")
    (out / "summary.json").write_text(json.dumps({"rows": rows}, indent=2))
    print(table)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
