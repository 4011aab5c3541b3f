"""The run directory: everything a run writes, and everything needed to resume it.

    runs/NAME/
      config.yaml            the resolved config (what actually ran)
      metrics.jsonl          one JSON object per training step and per evaluation
      tb/                    TensorBoard events
      checkpoints/step_N/    model/ (weights or adapter), optimizer.pt, state.pt
      samples/               a few evaluated completions per evaluation, for reading
      report.md, curves.png  written at the end of training

Checkpoints are written to a temporary folder and renamed, so a crash leaves the previous one intact.
On resume, metrics rows after the checkpoint's step are dropped (they are about to be redone) and
TensorBoard purges the same steps.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

CHECKPOINT_PREFIX = "step_"


class RunDir:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.checkpoints = self.path / "checkpoints"

    @property
    def config_path(self) -> Path:
        return self.path / "config.yaml"

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    def exists(self) -> bool:
        return self.config_path.is_file()

    def latest_checkpoint(self) -> Path | None:
        if not self.checkpoints.is_dir():
            return None
        done = [p for p in self.checkpoints.iterdir() if p.name.startswith(CHECKPOINT_PREFIX) and (p / "state.pt").is_file()]
        return max(done, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX):]), default=None)

    # ------------------------------------------------------------------ metrics

    def truncate_metrics(self, after_step: int) -> None:
        """Drop rows logged after `after_step` (they belong to work the resumed run redoes)."""
        if not self.metrics_path.is_file():
            return
        keep = [line for line, row in self._rows() if row.get("step", 0) <= after_step]
        tmp = self.metrics_path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        os.replace(tmp, self.metrics_path)

    def log(self, row: dict[str, Any]) -> None:
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(row) + "\n")

    def _rows(self) -> list[tuple[str, dict]]:
        """(line, row) for every complete row; a line torn by a crash mid-write is skipped."""
        out = []
        for line in self.metrics_path.read_text().splitlines():
            try:
                out.append((line, json.loads(line)))
            except json.JSONDecodeError:
                continue
        return out

    def read_metrics(self) -> list[dict]:
        if not self.metrics_path.is_file():
            return []
        return [row for _, row in self._rows()]

    # -------------------------------------------------------------- checkpoints

    def save_checkpoint(self, step: int, model, optimizer, state: dict, keep: int = 2) -> Path:
        from lopd.models import save_weights

        final = self.checkpoints / f"{CHECKPOINT_PREFIX}{step:06d}"
        tmp = self.checkpoints / f".tmp_{CHECKPOINT_PREFIX}{step:06d}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_weights(model, tmp / "model")
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save({**state, "rng": rng_state()}, tmp / "state.pt")  # written last: marks the folder complete
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        done = sorted((p for p in self.checkpoints.iterdir() if p.name.startswith(CHECKPOINT_PREFIX)),
                      key=lambda p: int(p.name[len(CHECKPOINT_PREFIX):]))
        for old in done[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def load_checkpoint(self, folder: Path, model, optimizer) -> dict:
        from lopd.models import load_weights

        load_weights(model, folder / "model")
        optimizer.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=False))
        state = torch.load(folder / "state.pt", weights_only=False)
        set_rng_state(state.pop("rng"))
        return state


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
