"""DDP under torchrun, two gloo processes, nanwatch attached to the DDP wrapper itself: site names are
the user's model's (no ``module.`` prefix) and the logits site is found through the wrapper."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import free_port

pytest.importorskip("transformers")


@pytest.mark.slow
def test_attached_to_the_ddp_wrapper_sites_are_the_users_and_lm_head_is_there(tmp_path: Path):
    worker = Path(__file__).with_name("ddp_worker.py")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "--master_addr=127.0.0.1", str(worker), str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, r in enumerate(reports):
        assert (r["rank"], r["world_size"]) == (rank, 2)
        sites = {tuple(s) for s in r["sites"]}
        assert not [s for s, _ in sites if s.startswith("module.")], sites
        assert {("model.layers.0.self_attn", "forward"), ("model.layers.1.self_attn", "backward"),
                ("lm_head", "forward"), ("lm_head", "backward")} <= sites
        assert r["coverage"]["unmeasured"] == [] and r["coverage"]["logits"]
        assert r["first_offender"] is None
