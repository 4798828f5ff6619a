"""Writes ``docs/reference.md`` from the code: the trainer's options (``MonitorConfig``'s fields and its
sections', read with ``dataclasses.fields``, each with its flat option name from ``FLAT_OPTIONS``), the
collector's settings (``Settings``, one ``NANWATCH_*`` variable each) and the metrics
(``monitor/read/metric_names.py``, the one table of names).

    python docs/generate.py          # rewrite docs/reference.md
    python docs/generate.py --check  # exit 1 if it is stale (tests/test_docs.py does the same)

The config is imported (its sections, order, types and defaults are what ``dataclasses.fields`` says);
Python keeps no field docstrings at run time, so those are read from each class's source. The settings are
read from the source alone (no web stack imported); the metric table is imported, since its help strings
are built by Python.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "reference.md"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _field_docs(tree: ast.ClassDef) -> dict[str, str]:
    """Field name -> the docstring right under it, in a parsed class."""
    body = tree.body
    return {node.target.id: after.value.value for node, after in zip(body, [*body[1:], None], strict=True)
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)}


def docstrings(cls: type) -> dict[str, str]:
    """The field docstrings of the class ``cls``, from its source."""
    return _field_docs(ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0])


def class_fields(path: Path, name: str) -> list[tuple[str, str, str, str]]:
    """(field, annotation, default, docstring) of every annotated field of class ``name`` in ``path``, in
    source order, read from the source alone (for a class whose module is not imported here)."""
    source = path.read_text()
    (cls,) = [n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == name]
    docs = _field_docs(cls)
    return [(n.target.id, ast.get_source_segment(source, n.annotation),
             ast.get_source_segment(source, n.value) if n.value is not None else "required",
             docs.get(n.target.id, ""))
            for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]


def _code(value: str) -> str:
    return value if value.startswith("(") else f"`{_cell(value)}`"


def _default(f: dataclasses.Field) -> str:
    """A field's default as the reference shows it: code, or a note in parentheses."""
    if not f.init:
        return "(filled in, not an option)"
    if f.default is dataclasses.MISSING:
        return "required" if f.default_factory is dataclasses.MISSING else repr(f.default_factory())
    value = f.default
    if callable(value):
        return value.__name__
    big = isinstance(value, int) and not isinstance(value, bool) and value >= 10_000
    return f"{value:_}" if big else repr(value)


def config_rows() -> list[tuple[str, str, str, str, str, str]]:
    """(section, flat option name, field path, type, default, docstring) of every field of ``MonitorConfig``
    and of its sections, in declaration order; the section "" is the top level."""
    from nanwatch.hooks.config import FLAT_OPTIONS, MonitorConfig

    flat_of = {path: flat for flat, path in FLAT_OPTIONS.items()}
    rows, top_docs = [], docstrings(MonitorConfig)
    for f in dataclasses.fields(MonitorConfig):
        if dataclasses.is_dataclass(f.default_factory):
            section, docs = f.name, docstrings(f.default_factory)
            rows += [(section, flat_of.get(f"{section}.{g.name}", ""), f"{section}.{g.name}", g.type,
                      _default(g), docs.get(g.name, "")) for g in dataclasses.fields(f.default_factory)]
        else:
            rows.append(("", flat_of.get(f.name, ""), f.name, f.type, _default(f), top_docs.get(f.name, "")))
    return rows


def _options() -> list[str]:
    from nanwatch.hooks.config import SECTIONS

    out = ["## Trainer options", "",
           "`MonitorConfig` (`hooks/config.py`): the run's identity, then one section per concern, each a "
           "dataclass of its own that the part doing that work receives. `nanwatch.attach(model, ...)`, "
           "`NanwatchCallback(...)` and `nanwatch bench kernels --config` take the flat option names (first "
           "column; `MonitorConfig.from_options` builds a config from them); "
           "`MonitorConfig(run_id=..., spikes=SpikesConfig(factor=5))` takes sections. Constructing a config "
           "reads nothing; `resolve_config` fills what is left to the environment and picks the shard."]
    section = None
    for s, flat, path, annotation, default, doc in config_rows():
        if s != section:
            section = s
            if s:
                cls = SECTIONS[s]
                intro = ["", f"### {s}", "", f"`{cls.__name__}`: {_cell(inspect.getdoc(cls) or '')}"]
            else:
                intro = ["", "### The run and where it reports"]
            out += [*intro, "", "| option | field | type | default | what it does |", "|---|---|---|---|---|"]
        option = f"`{flat}`" if flat else "—"
        out.append(f"| {option} | `{path}` | `{_cell(annotation)}` | {_code(default)} | {_cell(doc)} |")
    return out


def _settings() -> list[str]:
    rows = class_fields(ROOT / "monitor" / "settings.py", "Settings")
    out = ["", "## Collector settings", "",
           "`Settings` fields (`monitor/settings.py`): each is the environment variable `NANWATCH_<FIELD>` "
           "(maps and lists as JSON), read when `nanwatch serve` starts.", "",
           "| variable | type | default | what it does |", "|---|---|---|---|"]
    for name, annotation, default, doc in rows:
        if name == "model_config":
            continue
        out.append(f"| `NANWATCH_{name.upper()}` | `{_cell(annotation)}` | {_code(default)} | {_cell(doc)} |")
    return out


def _metrics() -> list[str]:
    sys.path.insert(0, str(ROOT))
    from nanwatch.monitor.read.metric_names import METRICS

    out = ["", "## Metrics", "",
           "Every metric `/metrics` exposes (`monitor/read/metric_names.py`, the one table the exporter renders "
           "from). The names are public API: dashboards, alert rules and people's queries use them.", "",
           "| metric | type | labels | help |", "|---|---|---|---|"]
    for spec in METRICS.values():
        labels = ", ".join(spec.labels) or "—"
        out.append(f"| `{spec.name}` | {spec.type} | {labels} | {_cell(spec.help)} |")
    out += ["", "The collector process's own `process_*` and `python_info` series (prometheus_client's default "
            "collectors) are exposed beside them."]
    return out


def render() -> str:
    head = ["# Reference", "",
            "<!-- generated by docs/generate.py from the code; do not edit: run `python docs/generate.py` -->", "",
            "The trainer's options, the collector's settings and the metrics, as the code defines them. "
            "What they are for: the [README](../README.md) and the pages beside this one.", ""]
    return "\n".join([*head, *_options(), *_settings(), *_metrics()]) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if OUT.read_text() != text:
            print(f"{OUT.relative_to(ROOT)} is stale: run python docs/generate.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
