"""`lopd eval --json F`: written after every split, and resumed from (a split F holds under the same config
and checkpoint is kept, not evaluated again), so a killed evaluation of a large benchmark keeps its work."""

import json

from lopd.cli import main


def _eval(tmp_path, capsys, *splits, overrides=()):
    args = ["eval", "--model", "tiny", "--env", "toolworld", "--json", str(tmp_path / "out.json"),
            "--split", *splits, "eval.max_tasks=3", "rollout.max_new_tokens=8", "run.progress=false", *overrides]
    assert main(args) == 0
    return capsys.readouterr().out, json.loads((tmp_path / "out.json").read_text())


def test_eval_json_is_written_per_split_and_resumed(tmp_path, capsys):
    out, first = _eval(tmp_path, capsys, "test")
    assert set(first["splits"]) == {"test"} and first["splits"]["test"]["n"] == 3
    outcomes = first["splits"]["test"]["outcomes"]  # task by task, for paired comparisons
    from lopd.envs.toolworld import ToolWorld

    assert list(outcomes) == [str(t.id) for t in ToolWorld().tasks("test")[:3]]
    assert sum(outcomes.values()) == round(3 * first["splits"]["test"]["success"])
    assert "already evaluated" not in out
    # a sentinel in the file: a split that is kept is read back, not evaluated again
    first["splits"]["test"]["success"] = 0.625
    (tmp_path / "out.json").write_text(json.dumps(first))
    out, second = _eval(tmp_path, capsys, "test", "transfer")
    assert "test already evaluated under these settings (kept)" in out
    assert set(second["splits"]) == {"test", "transfer"} and second["splits"]["test"]["success"] == 0.625
    assert second["splits"]["transfer"]["n"] == 3
    weighted = 100 * (3 * 0.625 + 3 * second["splits"]["transfer"]["success"]) / 6
    assert f"| **{weighted:.1f}** |" in out  # the printed table is made from the kept figure
    # other settings: every split is evaluated again
    out, third = _eval(tmp_path, capsys, "test", overrides=["rollout.max_new_tokens=9"])
    assert "written under other settings" in out
    assert third["max_new_tokens"] == 9 and third["splits"]["test"]["success"] != 0.625


def test_eval_json_that_is_not_json_is_a_one_line_error(tmp_path, capsys):
    (tmp_path / "out.json").write_text('{"model": "tiny", "spl')  # half a file
    args = ["eval", "--model", "tiny", "--env", "toolworld", "--json", str(tmp_path / "out.json"), "--split", "test",
            "eval.max_tasks=2", "rollout.max_new_tokens=4"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"lopd: error: {tmp_path / 'out.json'}: not a JSON file of lopd eval") and "\n" not in err
