"""A capsule is data, never code: ``nanwatch replay`` on hand-made hostile capsules (issue #27, findings 1-5).

Every capsule here is written by hand with safetensors' ``save_file`` and crafted ``metadata``; none comes
from a trainer. A malformed one exits 2 with one line naming what is wrong (never a traceback, never exit 1,
which means only "not reproducible"); a constructor asking for more than the declared bounds is refused
before anything is allocated; a config naming remote code or a Hub backbone is refused, and a fake Hub on
loopback sees no request."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from nanwatch.cli.replay_verdict import main
from nanwatch.hooks.forensics.capsule import FORMAT, META_KEY, digest


def _meta(build: dict, **extra) -> dict:
    return {"format": FORMAT, "fqn": "m", "build": build, "training": False, "params": [], "buffers": [],
            "args": [], "kwargs": {}, "dropped": [], "incident": {"cls": "precision"}, **extra}


def _write(path: Path, meta: dict | str, tensors: dict[str, torch.Tensor] | None = None, *,
           digests: bool = True) -> str:
    """A capsule by hand: ``meta`` as the nanwatch metadata string (a str is written as it is)."""
    tensors = {k: v.contiguous() for k, v in (tensors or {}).items()}
    if isinstance(meta, dict) and digests:
        meta = {**meta, "digests": {k: digest(v) for k, v in tensors.items()}}
    text = meta if isinstance(meta, str) else json.dumps(meta)
    save_file(tensors, str(path), metadata={META_KEY: text})
    return str(path)


def _linear(path: Path, **over) -> str:
    """A valid capsule: Linear(4, 3) with a NaN weight, one input (data_mask, exit 0)."""
    w = torch.ones(3, 4)
    w[0, 0] = float("nan")
    tensors = {"param.weight": w, "param.bias": torch.zeros(3), "arg.0": torch.ones(2, 4)}
    meta = _meta({"kind": "nn", "class": "torch.nn.modules.linear:Linear",
                  "args": {"in_features": 4, "out_features": 3, "bias": True}, "missing": []},
                 params=["param.weight", "param.bias"], args=[{"tensor": "arg.0"}])
    extra = over.pop("tensors", {})
    return _write(path, {**meta, **over}, {**tensors, **extra})


def _refused(capsys, path: str, *extra: str) -> str:
    """main's exit code is 2 and its stderr is one line, no traceback; that line."""
    code = main([path, "--try", "same,fp32", *extra])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err.strip()


def test_a_valid_hand_made_capsule_replays_and_a_bound_below_it_refuses_it(tmp_path, capsys):
    path = _linear(tmp_path / "ok.capsule")
    assert main([path, "--try", "same,fp32"]) == 0  # data_mask: the helper writes real capsules
    capsys.readouterr()
    assert "--max-params" in _refused(capsys, path, "--max-params", "10")  # 15 parameters
    assert "--max-bytes" in _refused(capsys, path, "--max-bytes", "32")  # 60 bytes, and 60 more for fp32


def test_a_huge_embedding_without_weights_is_refused_before_it_is_allocated(tmp_path, capsys):
    # finding 2: a few hundred bytes asking for Embedding(2**26, 8), no weights in the file (4.3 GiB peak)
    path = _write(tmp_path / "big.capsule", _meta({"kind": "nn", "class": "torch.nn.modules.sparse:Embedding",
                                                   "args": {"num_embeddings": 2**26, "embedding_dim": 8}}))
    assert os.path.getsize(path) < 1024
    line = _refused(capsys, path)
    assert "536,870,912 parameters" in line and "--max-params" in line


def _run(path: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    code = "import sys; from nanwatch.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, "replay", path, "--try", "same"], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": "", **(env or {})}, timeout=timeout,
                          stdin=subprocess.DEVNULL, cwd=os.path.dirname(path))


def test_a_config_with_a_million_layers_is_refused_by_its_parameter_count(tmp_path):
    # finding 3: a tiny HF config with 10^6 layers built for ever; the count is estimated on the meta device
    # from one and two layers, before the real thing is built (the timeout only stops today's endless build)
    cfg = {"model_type": "qwen3", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
           "num_hidden_layers": 10**6, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8}
    path = _write(tmp_path / "deep.capsule", _meta({
        "kind": "hf", "class": "transformers.models.qwen3.modeling_qwen3:Qwen3Model",
        "config_class": "transformers.models.qwen3.configuration_qwen3:Qwen3Config", "config": cfg, "hints": {}}))
    p = _run(path, timeout=90)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "parameters" in p.stderr and "--max-params" in p.stderr


@pytest.fixture
def fake_hub():
    """An HTTP server on loopback that logs every request: HF_ENDPOINT points at it."""
    seen: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def _any(self) -> None:
            seen.append(f"{self.command} {self.path}")
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_GET = do_HEAD = do_POST = _any

        def log_message(self, *a) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", seen
    srv.shutdown()


def _hub_env(endpoint: str, tmp_path: Path) -> dict[str, str]:
    env = {"HF_ENDPOINT": endpoint, "HF_HOME": str(tmp_path / "hf"), "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}
    for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.pop(k, None)  # the replay sets offline mode itself; the test's own environment does not
    return env


def test_a_backbone_named_in_the_config_never_reaches_the_hub(tmp_path, fake_hub):
    # finding 4: RfDetrConfig with `backbone` set called repo_exists while rebuilding
    endpoint, seen = fake_hub
    cfg = {"model_type": "rf_detr", "backbone": "capsule-author/opened-from-where", "use_pretrained_backbone": False}
    path = _write(tmp_path / "hub.capsule", _meta({
        "kind": "hf", "class": "transformers.models.rf_detr.modeling_rf_detr:RfDetrModel",
        "config_class": "transformers.models.rf_detr.configuration_rf_detr:RfDetrConfig", "config": cfg,
        "hints": {}}))
    p = _run(path, _hub_env(endpoint, tmp_path))
    assert seen == [], seen
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "backbone" in p.stderr


def test_an_auto_map_in_a_backbone_config_is_refused_without_a_prompt(tmp_path, fake_hub):
    # finding 1: DetrConvEncoder whose backbone_config carries an auto_map asked "run the custom code? [y/N]"
    endpoint, seen = fake_hub
    cfg = {"model_type": "detr", "use_timm_backbone": False, "use_pretrained_backbone": False, "backbone": None,
           "backbone_config": {"model_type": "resnet",
                               "auto_map": {"AutoBackbone": "capsule-author/evil--modeling.Backbone",
                                            "AutoConfig": "capsule-author/evil--configuration.Config"}}}
    path = _write(tmp_path / "code.capsule", _meta({
        "kind": "hf", "class": "transformers.models.detr.modeling_detr:DetrConvEncoder",
        "config_class": "transformers.models.detr.configuration_detr:DetrConfig", "config": cfg, "hints": {}}))
    p = _run(path, _hub_env(endpoint, tmp_path))
    assert "custom code" not in p.stdout + p.stderr
    assert seen == [], seen
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "auto_map" in p.stderr
    assert not (tmp_path / "hf" / "modules").exists()


_NN = {"kind": "nn", "class": "torch.nn.modules.linear:Linear", "args": {"in_features": 4, "out_features": 3}}


def _malformed(tmp_path: Path, case: str) -> str:
    p = tmp_path / f"{case}.capsule"
    if case == "deep_json":
        return _write(p, "[" * 100_000 + "]" * 100_000)
    if case == "deep_spec":
        spec: dict = {"value": 1}
        for _ in range(200):
            spec = {"seq": [spec]}
        return _linear(p, args=[spec])
    if case == "no_build":
        return _write(p, {k: v for k, v in _meta(_NN).items() if k != "build"})
    if case == "build_string":
        return _write(p, _meta("torch.nn.Linear"))  # type: ignore[arg-type]
    if case == "missing_input":
        return _linear(p, args=[{"tensor": "arg.gone"}])
    if case == "unknown_keyword":
        return _linear(p, kwargs={"bogus": {"value": 1}})
    if case == "float_rng":
        return _linear(p, tensors={"rng.cpu": torch.zeros(5056)})
    if case == "dtype_not_a_dtype":
        return _linear(p, args=[{"tensor": "arg.0"}, {"dtype": "load"}])
    if case == "incident_string":
        return _linear(p, incident="precision")
    if case == "args_not_a_list":
        return _linear(p, args=5)
    if case == "autocast_dtype":
        return _linear(p, autocast={"enabled": True, "dtype": "load"})
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["deep_json", "deep_spec", "no_build", "build_string", "missing_input",
                                  "unknown_keyword", "float_rng", "dtype_not_a_dtype", "incident_string",
                                  "args_not_a_list", "autocast_dtype"])
def test_a_malformed_capsule_exits_2_with_one_line(tmp_path, capsys, case):
    # finding 5: 10 of 12 malformed capsules crashed with a traceback and exit 1 ("not reproducible")
    line = _refused(capsys, _malformed(tmp_path, case))
    assert line.startswith("nanwatch replay: ")


def _long_attribution_capsule(tmp_path: Path, *, sequences: int = 32, length: int = 8192) -> str:
    """A genuine attribution capsule (the writer's own ``capture_model``) of a tiny Qwen3 over ``sequences`` x
    ``length`` tokens, as #37's finding 8 made it (about 3 MiB): built in a blink, minutes to redo."""
    from support import tiny_qwen3

    from nanwatch.hooks.forensics.capsule import CapsuleWriter

    model = tiny_qwen3("sdpa", seed=0, max_position_embeddings=length)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (sequences, length), generator=g)
    c = min(64, length - 1)
    inputs = {"input_ids": ids, "rollout_logprobs": -torch.rand(sequences, c, generator=g),
              "trainer_logprobs": -torch.rand(sequences, c, generator=g),
              "completion_mask": torch.ones(sequences, c, dtype=torch.bool)}
    writer = CapsuleWriter(run_id="long", rank=0, directory=str(tmp_path), max_count=1, max_bytes=64 << 20)
    path = writer.capture_model(kind="attribution", step=3, model=model, inputs=inputs, extra={
        "rollout_dtype": "bfloat16", "temperature": 1.0, "attribution": {"module": "lm_head", "cause": "drift"}})
    writer.join()
    assert path
    return path


@pytest.mark.parametrize(("flags", "over"), [((), "--max-run-s 300"),
                                              (("--max-run-s", "1e9", "--max-bytes", "100000000"),
                                               "--max-bytes 100,000,000")])
def test_an_attribution_capsule_too_long_to_redo_is_refused_before_it_runs(tmp_path, capsys, flags, over):
    """32 sequences x 8,192 tokens: counted before anything runs, against --max-run-s (default 300 s at the
    assumed rate) and one forward's activations against --max-bytes; exit 2, one line naming what was over
    and which flag raises it (#37, finding 8). No time is measured here: today's code ran it for minutes."""
    path = _long_attribution_capsule(tmp_path)
    assert os.path.getsize(path) > 2 << 20  # about 3 MiB: the recorded token ids, mostly
    line = _refused(capsys, path, *flags)
    assert "32 sequences x 8,192 tokens" in line and over in line, line
    assert "refused before it runs" in line and f"raise {over.split()[0]}" in line, line


def test_a_capsule_is_never_written_through_a_planted_link(tmp_path):
    """A shared capsule folder: a link planted at the capsule's name, or at the predictable temporary name the
    writer once used (``<path>.<pid>.tmp``), is never followed; the victim keeps its bytes."""
    import os

    from nanwatch.hooks.forensics.capsule import _write_new

    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    path = tmp_path / "caps" / "run-r0-s3-precision.capsule"
    path.parent.mkdir()
    os.symlink(victim, f"{path}.{os.getpid()}.tmp")
    os.symlink(victim, path)
    _write_new(str(path), b"capsule bytes")
    assert victim.read_bytes() == b"keep me"
    assert not path.is_symlink() and path.read_bytes() == b"capsule bytes"
    assert oct(path.stat().st_mode & 0o777) == oct(0o600)
