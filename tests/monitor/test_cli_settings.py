"""The CLI against a real collector, exposure rules, and what each side may import."""

import subprocess
import sys

import pytest
from support import JSON, step_report

from nanwatch.cli import main
from nanwatch.monitor import Settings, create_app
from nanwatch.wire import ReportBatch


def test_status_and_directive_commands(collector, capsys):
    import httpx

    body = ReportBatch(reports=[step_report(run_id="cli", seq=0, nan_at="model.layers.1.self_attn", nan=2,
                                            dtype="float32")]).model_dump_json()
    assert httpx.post(f"{collector.url}/v1/reports", content=body,
                      headers={"Authorization": f"Bearer {collector.token}", **JSON}).status_code == 200
    assert main(["directive", "set", "cli", "fp32", "--apply-at-step", "7", "--url", collector.url,
                 "--admin-token", collector.admin_token]) == 0
    assert "directive v1 fp32 from step 7" in capsys.readouterr().out
    assert main(["status", "cli", "--url", collector.url, "--token", collector.token]) == 0
    out = capsys.readouterr().out
    assert "first non-finite: model.layers.1.self_attn (forward, train) on rank 0 at step 0" in out
    assert "set by alice" in out
    assert main(["directive", "clear", "cli", "--url", collector.url, "--admin-token", collector.admin_token]) == 0
    assert main(["status", "--url", collector.url, "--token", collector.token]) == 0
    assert "cli: live, 1 live ranks, step 0, 2 non-finite site visits, 0 skipped steps, directive v2 none" in (
        capsys.readouterr().out)
    with pytest.raises(SystemExit) as refused:  # one line on stderr, exit 2 (#27: the CLI's errors)
        main(["directive", "clear", "cli", "--url", collector.url, "--admin-token", "wrong"])
    assert refused.value.code == 2 and "HTTP 401" in capsys.readouterr().err


def test_exposed_host_without_tokens_is_refused():
    with pytest.raises(ValueError, match="NANWATCH_TOKEN and NANWATCH_ADMIN_TOKEN"):
        create_app(Settings(host="0.0.0.0", db_path=":memory:"))
    create_app(Settings(host="0.0.0.0", db_path=":memory:", token="a", admin_token="b"))
    out = subprocess.run([sys.executable, "-m", "nanwatch.cli", "serve", "--host", "0.0.0.0", "--db", ":memory:"],
                         capture_output=True, text=True, env={"PATH": ""}, timeout=60)
    assert out.returncode == 2 and "refusing to listen on '0.0.0.0'" in out.stderr


def test_token_file_is_read_and_named(tmp_path):
    f = tmp_path / "tok"
    f.write_text("s3cret\n")
    assert Settings(token_file=f).ingest_tokens() == {"ingest-file": "s3cret"}
    with pytest.raises(ValueError, match="cannot read"):
        Settings(admin_token_file=tmp_path / "missing").admin_token_map()


def test_missing_delegate_is_an_error_not_a_crash(capsys, monkeypatch):
    import nanwatch.cli as cli

    monkeypatch.setitem(cli._DELEGATES, "bench", ("nanwatch.hooks.no_such_module", "absent"))
    assert main(["bench", "--help"]) == 2
    assert "nanwatch.hooks.no_such_module is not available" in capsys.readouterr().err


@pytest.mark.parametrize("module,banned", [
    ("nanwatch.monitor", ("torch",)),
    ("nanwatch.monitor.app", ("torch",)),
    ("nanwatch.bench.load", ("torch", "fastapi", "uvicorn", "starlette", "prometheus_client")),
    ("nanwatch.wire", ("torch", "fastapi", "uvicorn", "starlette", "prometheus_client")),
    ("nanwatch.hooks", ("fastapi", "uvicorn", "starlette", "prometheus_client")),
    ("nanwatch.cli", ("torch", "fastapi", "uvicorn", "starlette", "prometheus_client")),
])
def test_import_boundaries(module, banned):
    code = f"import sys, {module}; bad = [m for m in {banned!r} if m in sys.modules]; print(bad); sys.exit(bool(bad))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


_URL = "postgresql://nanwatch:hunter2@127.0.0.1:9/nanwatch"


@pytest.mark.parametrize(("flags", "env", "named"), [
    (["--db", "x.db", "--database-url", _URL], {}, ("--db 'x.db'", "--database-url")),
    (["--db", "x.db"], {"NANWATCH_DATABASE_URL": _URL}, ("--db 'x.db'", "NANWATCH_DATABASE_URL")),
    (["--db", "x.db"], {"NANWATCH_DATABASE_URL_FILE": "url"}, ("--db 'x.db'", "NANWATCH_DATABASE_URL_FILE")),
    (["--database-url", _URL], {"NANWATCH_DB_PATH": "x.db"}, ("NANWATCH_DB_PATH 'x.db'", "--database-url")),
    ([], {"NANWATCH_DB_PATH": "x.db", "NANWATCH_DATABASE_URL": _URL}, ("NANWATCH_DB_PATH", "NANWATCH_DATABASE_URL")),
    ([], {"NANWATCH_DATABASE_URL": _URL, "NANWATCH_DATABASE_URL_FILE": "url"},
     ("NANWATCH_DATABASE_URL and NANWATCH_DATABASE_URL_FILE", "once")),
])
def test_serve_refuses_a_sqlite_file_beside_a_database_url(flags, env, named, monkeypatch, capsys, tmp_path):
    """#40: ``--db`` with ``--database-url`` was served from the URL, silently. A SQLite file and a PostgreSQL
    URL named at once, from flags or the environment in any mix, and the URL named twice, are exit 2 before
    anything opens, naming where each came from, never the password (docs/operating.md)."""
    monkeypatch.chdir(tmp_path)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert main(["serve", "--port", "0", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nanwatch serve: both ") and all(n in err for n in named), err
    assert "hunter2" not in err and not (tmp_path / "x.db").exists()


def test_a_database_url_flag_beats_the_environments_url_and_the_app_refuses_two_stores(monkeypatch, capsys):
    """One setting from a flag and from the environment is one value replacing another (the flag's), not two
    stores: the URL flag is taken over ``NANWATCH_DATABASE_URL_FILE`` (here unreachable: its own exit 2). The
    app itself (``uvicorn --factory``, an embedding) refuses two stores too."""
    pytest.importorskip("psycopg")
    monkeypatch.setenv("NANWATCH_DATABASE_URL_FILE", "/nonexistent/url")
    assert main(["serve", "--port", "0", "--database-url", _URL]) == 2
    assert "cannot reach the database postgresql://nanwatch:***@127.0.0.1:9" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"both a SQLite file \(--db / NANWATCH_DB_PATH 'n.db'\)"):
        create_app(Settings(db_path="n.db", database_url=_URL))
