"""Run by test_training.py under `accelerate launch --cpu --num_processes 2`: trains a tiny head with DDP
and writes each process's final head parameters, so the test can check the processes stayed in sync."""

import sys
from pathlib import Path

import torch
from accelerate import Accelerator

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parent.parent)]  # this folder, and conftest
from conftest import tiny_orthrus  # noqa: E402
from test_training import synthetic_records  # noqa: E402

from lossless.training.train import TrainConfig, train  # noqa: E402

out = Path(sys.argv[1])
accelerator = Accelerator(cpu=True)
model = tiny_orthrus("llama", k=4)
cfg = TrainConfig(out=str(out / "head"), k=4, steps=4, lr=1e-3, warmup=1, seqs_per_step=4, anchors=4,
                  save_every=0, eval_every=0)
summary = train(model, synthetic_records(), cfg, accelerator=accelerator, progress=False)
flat = torch.cat([p.detach().reshape(-1) for p in model.head_parameters().values()])
torch.save({"world": accelerator.num_processes, "flat": flat, "history": summary["history"]},
           out / f"rank{accelerator.process_index}.pt")
