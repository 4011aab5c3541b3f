"""`lopd inspect`: the slot summary on hand-made slots, and the command on a real (tiny) LOPD run."""

import math

import pytest
import torch

from conftest import copy_run
from lopd.errors import ConfigError
from lopd.inspection import inspect_run, slot_summary


def test_slot_summary_by_hand():
    same = torch.tensor([[1.0, 2.0, 0.0]] * 4)  # [K=4, H=3]: one direction, different lengths below
    same[1] *= 3.0
    weights = torch.tensor([[0.1, 0.7, 0.2], [0.0, 0.9, 0.1], [0.5, 0.4, 0.1], [0.2, 0.3, 0.5]])  # [K, M]
    out = slot_summary(same, weights)
    assert out["cosine"] == pytest.approx(1.0)
    assert out["shared_focus"] == pytest.approx(2 / 4)  # slots 0 and 1 peak on token 1; 2 and 3 elsewhere
    # e1, e2, e1 + e2: pairs (0,1) 0, (0,2) and (1,2) 1/sqrt(2); the mean over the 6 ordered pairs
    mixed = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    assert slot_summary(mixed)["cosine"] == pytest.approx(2 * (0 + 2 / math.sqrt(2)) / 6)
    assert "shared_focus" not in slot_summary(mixed)
    assert slot_summary(-same)["cosine"] == pytest.approx(1.0)  # a negative gate flips every slot alike
    assert math.isnan(slot_summary(torch.zeros(4, 3))["cosine"])  # a closed gate adds no direction


def test_inspect_a_tiny_lopd_run(reference_runs, tmp_path):
    from lopd.runs import RunDir

    run = copy_run(reference_runs["lopd"], tmp_path / "run")  # the canonical LOPD run: its gate starts open

    alike = [r["context/slot_cosine"] for r in RunDir(run).read_metrics() if "context/slot_cosine" in r]
    assert alike and all(-1.0 <= a <= 1.0 for a in alike)  # logged where the gate is open
    png, md = inspect_run(run, tasks=2, split="test")
    text = md.read_text()
    assert png.stat().st_size > 10_000 and text.count("\n## test-") == 2
    assert ("slots over the context" in text and "Slots alike" in text) or "Nothing retrieved" in text
    with pytest.raises(ConfigError, match="not a run directory"):
        inspect_run(tmp_path / "nowhere")


def test_inspect_a_compressor_run(reference_runs, tmp_path):
    """A compressor's slots are its own (under no context token): their nearest tokens, how alike they are,
    and the last decoder layer's attention of each memory column over the context's tokens."""
    run = copy_run(reference_runs["lopd_pretrained"], tmp_path / "run")
    png, md = inspect_run(run, tasks=8, split="test")  # the 4-step run's bank has a success for some of them
    text = md.read_text()
    assert png.stat().st_size > 10_000 and text.count("\n## test-") == 8
    found = text.count("16 slots of their own for ")
    assert found + text.count("Nothing retrieved") == 8 and found >= 1
    assert text.count("Slots alike: mean pairwise cosine") == found and "nearest token (cosine): 0: " in text
