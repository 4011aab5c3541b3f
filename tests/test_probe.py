"""`lopd probe`: the within-group privilege AUC by hand, and a tiny probe end to end through the CLI path
(every figure of the no-context source is 0 by construction; the reference covers every trajectory; the
compressor's slots count K tokens)."""

import json
import math

import pytest

from lopd.probe import auc_within_groups


def test_auc_within_groups_by_hand():
    # group 0: successes 0.3, 0.1 against failures 0.2, 0.0: 3 of 4 pairs won; group 1 unmixed (ignored);
    # group 2: one success 0.5 against a failure tied at 0.5: half a pair
    delta = [0.3, 0.1, 0.2, 0.0, 9.0, 9.0, 0.5, 0.5]
    success = [True, True, False, False, True, True, True, False]
    group = [0, 0, 0, 0, 1, 1, 2, 2]
    assert auc_within_groups(delta, success, group) == pytest.approx((3 + 0.5) / 5)
    assert math.isnan(auc_within_groups([0.1, 0.2], [True, True], [0, 0]))
    # rounding noise is a tie (the `none` source: a forward that batches the same rows differently)
    assert auc_within_groups([3e-8, -2e-8, 0.0], [True, False, False], [0, 0, 0]) == 0.5
    assert auc_within_groups([3e-6, -2e-6], [True, False], [0, 0]) == 1.0


def test_a_tiny_probe_end_to_end(tmp_path):
    from lopd.config import load_config
    from lopd.probe import ProbeSettings, run_probe

    settings = ProbeSettings(bank_rollouts=64, early_rollouts=16, val_tasks=4, group=4, latent_steps=2, latent_rows=8,
                             sources=["none", "reference", "task_tools:k2", "latent:K4:request:k2"])
    from conftest import THREADS

    cfg = load_config("lopd", ["env.toolworld.n_train=40", "rollout.tasks_per_step=2", "rollout.group_size=4",
                               "rollout.max_new_tokens=32", f"train.threads={THREADS}"])
    rows = {r["source"]: r for r in run_probe(cfg, settings, tmp_path, progress=lambda line: None)}
    none = rows["none"]
    assert none["gain_success"] == none["gain_failure"] == none["a_delta"] == none["shift"] == none["coverage"] == 0
    assert rows["reference"]["coverage"] == 1.0 and rows["reference"]["tokens"] > 5
    latent = rows["latent:K4:request:k2"]
    assert latent["tokens"] == 4 and (math.isnan(latent["kl_ratio"]) or latent["kl_ratio"] > 0)
    assert all(0 <= r["greedy"] <= 100 for r in rows.values())
    assert "| reference |" in (tmp_path / "probe.md").read_text()
    # resumable: the recorded sources are kept, not measured again
    again = run_probe(cfg, settings, tmp_path, progress=lambda line: None)
    assert [r["seconds"] for r in again] == [rows[s]["seconds"] for s in settings.sources]
    assert len(json.loads((tmp_path / "probe.json").read_text())["rows"]) == 4
