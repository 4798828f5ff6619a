"""Worker of tests/integrations/test_lightning.py's DDP test: ``strategy="ddp"`` with ``devices=2`` on the CPU;
Lightning relaunches this script for rank 1. Each rank writes ``rank<N>.json`` into ``$NANWATCH_OUT``."""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path

import lightning as L
import torch
from support import tiny_qwen3

from nanwatch.hooks.integrations.lightning import NanwatchCallback


class Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = tiny_qwen3("sdpa", vocab_size=64, hidden_size=32, intermediate_size=64, use_cache=False)
        self.automatic_optimization = os.environ.get("NANWATCH_MANUAL") != "1"  # NANWATCH_MANUAL=1: manual optimization
        self.now = -1
        self.model.model.layers[0].mlp.register_forward_hook(
            lambda m, a, out: out * math.nan if self.global_rank == 1 and self.now == 1 else out)

    def on_train_batch_start(self, batch, batch_idx):
        self.now = self.trainer.global_step  # the step this batch belongs to (a rerun at its end sees it too)

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        self.manual_backward(loss)
        opt.step()
        opt.zero_grad()
        return None

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    reports: list = []
    ids = torch.randint(0, 64, (16, 12), generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=2)
    module = Module()
    cb = NanwatchCallback(run_id="ddp", on_report=lambda r: reports.append(r) if not r.final else None)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=4, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False, logger=False, callbacks=[cb])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, data)
    train = [r for r in reports if r.stage == "train"]
    params = list(module.parameters())
    out = {"steps": [r.step for r in train], "skipped": [r.step_skipped for r in train],
           "offender": next((r.first_offender for r in train if r.first_offender), None),
           "world_size": train[0].world_size, "finite": all(bool(torch.isfinite(p).all()) for p in params),
           "checksum": float(sum(p.double().sum() for p in params))}
    (Path(os.environ["NANWATCH_OUT"]) / f"rank{trainer.global_rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
