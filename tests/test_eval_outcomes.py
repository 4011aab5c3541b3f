"""benchmarks/eval_outcomes.py: its interval and test against hand-computed values, and its reading of run dirs."""

import importlib.util
import json
import math
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("eval_outcomes", Path(__file__).parents[1] / "benchmarks" / "eval_outcomes.py")
eval_outcomes = importlib.util.module_from_spec(spec)
spec.loader.exec_module(eval_outcomes)


def test_wilson_interval_by_hand():
    # 0 of 10: [0, z^2 / (n + z^2)]
    z = 1.959964
    assert eval_outcomes.wilson(0, 10) == pytest.approx((0.0, z * z / (10 + z * z)))
    # 5 of 10: symmetric about 1/2, half-width z sqrt(1/40 + z^2/400) / (1 + z^2/10)
    half = z * math.sqrt(0.25 / 10 + z * z / 400) / (1 + z * z / 10)
    assert eval_outcomes.wilson(5, 10) == pytest.approx((0.5 - half, 0.5 + half))
    assert eval_outcomes.wilson(2, 82) == pytest.approx((0.0067, 0.0846), abs=1e-4)


def test_exact_mcnemar_by_hand():
    assert eval_outcomes.mcnemar_exact(0, 0) == 1.0
    assert eval_outcomes.mcnemar_exact(0, 5) == pytest.approx(2 / 32)  # both tails of Binomial(5, 1/2) at 0
    assert eval_outcomes.mcnemar_exact(1, 4) == pytest.approx(2 * 6 / 32)
    assert eval_outcomes.mcnemar_exact(3, 3) == 1.0


def test_summary_of_a_run_directory(tmp_path):
    def write(run, step, passes, completions):
        (run / "samples").mkdir(parents=True, exist_ok=True)
        rows = [{"id": f"P/{i}", "completion": c, "success": ok, "feedback": "" if ok else "SyntaxError: x"}
                for i, (ok, c) in enumerate(zip(passes, completions))]
        (run / "samples" / f"test_step{step:06d}.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n")

    a, b = tmp_path / "a", tmp_path / "b"
    write(a, 0, [True, False, False], ["x", "y", "z"])
    write(a, 4, [True, True, False], ["x", "y2", "z2"])
    write(b, 4, [False, False, True], ["x", "y", "z"])
    rows = eval_outcomes.summarise(a, "test")
    assert [r["step"] for r in rows] == [0, 4]
    assert rows[1]["solved"] == ["P/0", "P/1"] and rows[1]["changed_since_first"] == 2
    assert rows[0]["failures"] == {"SyntaxError": 2}
    with pytest.raises(SystemExit, match="no samples/val_step"):
        eval_outcomes.summarise(a, "val")


def write_val(run, step, passes):
    """A run's `val` evaluation at `step`: task t<i> solved where passes[i]."""
    (run / "samples").mkdir(parents=True, exist_ok=True)
    rows = [{"id": f"t{i}", "completion": "c", "success": ok} for i, ok in enumerate(passes)]
    (run / "samples" / f"val_step{step:06d}.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n")


def test_gain_over_seeds_and_tasks_by_hand(tmp_path):
    a, b = tmp_path / "seed0", tmp_path / "seed1"
    write_val(a, 0, [False, False, True, False])
    write_val(a, 8, [True, True, True, False])  # +2 of 4: gained 2, lost 0
    write_val(b, 0, [False, True, False, False])
    write_val(b, 8, [False, False, False, True])  # 0 of 4: gained 1, lost 1
    g = eval_outcomes.gain([a, b], "val", resamples=2000)
    assert [(r["gained"], r["lost"]) for r in g["runs"]] == [(2, 0), (1, 1)]
    assert g["runs"][0]["p_mcnemar"] == pytest.approx(0.5) and g["runs"][1]["p_mcnemar"] == 1.0
    assert g["mean_gain"] == pytest.approx(0.25)  # per task, seeds averaged: 0.5, 0, 0, 0.5
    # over seeds: gains 0.5 and 0.0, sd sqrt(0.125), t(1) = 12.706
    half = 12.706 * math.sqrt(0.125) / math.sqrt(2)
    assert g["seed_t95"] == pytest.approx([0.25 - half, 0.25 + half])
    lo, hi = g["task_bootstrap95"]  # resampled means of {0.5, 0, 0, 0.5}: within [0, 0.5], around 0.25
    assert 0.0 <= lo < 0.25 < hi <= 0.5
    with pytest.raises(SystemExit, match="fewer than 2 evaluation"):
        write_val(tmp_path / "once", 0, [True])
        eval_outcomes.gain([tmp_path / "once"], "val")


def test_versus_reference_by_seed_by_hand(tmp_path):
    mine, ref = tmp_path / "lopd", tmp_path / "grpo"
    write_val(ref / "seed0", 8, [True, False, False, False])
    write_val(ref / "seed1", 8, [False, False, True, True])
    write_val(mine / "seed0", 0, [False, False, False, False])  # only the last evaluation counts
    write_val(mine / "seed0", 8, [True, True, True, False])  # against ref seed0: gained 2, lost 0
    write_val(mine / "seed1", 8, [False, True, False, True])  # against ref seed1: gained 1, lost 1
    g = eval_outcomes.versus([mine / "seed1", mine / "seed0"], [ref / "seed0", ref / "seed1"], "val", resamples=2000)
    assert [(r["gained"], r["lost"]) for r in g["runs"]] == [(1, 1), (2, 0)]  # paired by name, not by order
    assert [(r["from"], r["to"]) for r in g["runs"]] == [(0.5, 0.5), (0.25, 0.75)]
    assert g["mean_gain"] == pytest.approx(0.25)
    # per task (seed1 diff, seed0 diff): t0 (0, 0), t1 (1, 1), t2 (-1, 1), t3 (0, 0) -> means 0, 1, 0, 0
    half = 12.706 * math.sqrt(0.125) / math.sqrt(2)  # differences 0.0 and 0.5
    assert g["seed_t95"] == pytest.approx([0.25 - half, 0.25 + half])
    with pytest.raises(SystemExit, match="no reference of 'seed2'"):
        write_val(mine / "seed2", 8, [True] * 4)
        eval_outcomes.versus([mine / "seed2"], [ref / "seed0"], "val")


def write_eval_json(path, passes, split="test"):
    """A `lopd eval --json` summary (the fields `EvalResult.summary` writes) whose `split` solved t<i> where passes[i]."""
    outcomes = {f"t{i}": ok for i, ok in enumerate(passes)}
    split_summary = {"n": len(passes), "success": sum(passes) / len(passes), "reward": sum(passes) / len(passes),
                     "modes": {}, "per_category": {}, "per_category_modes": {}, "outcomes": outcomes}
    path.write_text(json.dumps({"model": "m", "checkpoint": "c", "splits": {split: split_summary}}))
    return path


def test_versus_pairs_eval_json_files_by_the_seed_in_their_names(tmp_path):
    """The final checkpoints' `lopd eval --json` files pair like run directories: the same figures as
    test_versus_reference_by_seed_by_hand, matched by `seedN` in the file names."""
    ref = [write_eval_json(tmp_path / "grpo_seed0.json", [True, False, False, False]),
           write_eval_json(tmp_path / "grpo_seed1.json", [False, False, True, True])]
    mine = [write_eval_json(tmp_path / "lopd_seed1.json", [False, True, False, True]),
            write_eval_json(tmp_path / "lopd_seed0.json", [True, True, True, False])]
    g = eval_outcomes.versus(mine, ref, "test", resamples=2000)
    assert [(r["gained"], r["lost"]) for r in g["runs"]] == [(1, 1), (2, 0)]
    assert g["mean_gain"] == pytest.approx(0.25) and g["tasks"] == 4
    with pytest.raises(SystemExit, match="no split 'val'"):
        eval_outcomes.versus(mine, ref, "val")
    old = tmp_path / "old_seed0.json"
    old.write_text(json.dumps({"splits": {"test": {"n": 1, "success": 0.0}}}))
    with pytest.raises(SystemExit, match="has no 'outcomes'"):
        eval_outcomes.evaluations(old, "test")
