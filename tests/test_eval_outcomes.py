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
