"""`lopd compare` end to end on one 2-method x 1-seed grid trained once through the CLI: resume, report =
metrics.jsonl, extension, SIGTERM stops a grid and the same command resumes it; the report's statistics by hand."""

import json
import os
import statistics
import subprocess
import sys

import pytest

import zygote
from lopd.compare import cells, is_finished, load_grid
from lopd.errors import ConfigError
from lopd.grid_report import cost_of, stat
from lopd.runs import RunDir

GRID = """
name: tiny_grid
out: {out}
budget: 8
eval_every: 8
seeds: [0]
base: {configs}/grpo.yaml
overrides: [rollout.tasks_per_step=2, rollout.group_size=4, rollout.max_new_tokens=40, eval.max_tasks=4,
            env.toolworld.n_train=40, env.toolworld.n_test=8, env.toolworld.n_transfer=8, optim.lr=1e-3]
methods:
  grpo: {{}}
  opsd: {{config: {configs}/opsd.yaml}}
"""


@pytest.fixture
def grid_file(tmp_path):
    from lopd.cli import CONFIG_DIR

    path = tmp_path / "grid.yaml"
    path.write_text(GRID.format(out=tmp_path / "runs", configs=CONFIG_DIR))
    return path


def _compare(grid_file, *extra):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return zygote.run([sys.executable, "-m", "lopd.cli", "compare", "--config", str(grid_file), *extra],
                          capture_output=True, text=True, env=env, timeout=900, warm_children=True)


def test_grid_end_to_end_resume_sigterm_extension_and_report_equals_metrics(grid_file, tmp_path):
    """One grid, trained once: a half-finished grid completed, its report checked against metrics.jsonl, a
    second call that only rewrites the report, an extension to a larger budget stopped by SIGTERM and finished
    by the same command, and the report at the old budget unchanged."""
    import signal
    import time

    grid = load_grid(grid_file)
    all_cells = cells(grid)
    assert len(all_cells) == 2
    # a half-finished grid: one run already complete, before the CLI ever runs
    from lopd.compare import run_config
    from lopd.loop import train

    train(run_config(grid, all_cells[0]), quiet=True)
    done_mtime = (all_cells[0].path / "metrics.jsonl").stat().st_mtime
    out = _compare(grid_file)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "1 already finished" in out.stdout
    assert (all_cells[0].path / "metrics.jsonl").stat().st_mtime == done_mtime  # not redone
    assert all(is_finished(grid, c) for c in all_cells)
    root = tmp_path / "runs"
    for name in ("report.md", "report.json", "curves.png"):
        assert (root / name).is_file()
    report = json.loads((root / "report.json").read_text())
    # every reported number is what the runs' metrics.jsonl hold
    for method, entry in report["methods"].items():
        runs = [RunDir(p) for p in entry["runs"]]
        for split, s in entry["splits"].items():
            for point in s["points"]:
                truth = [next(r[f"eval/{split}/success"] for r in run.read_metrics()
                              if r["rollouts"] == point and f"eval/{split}/success" in r) for run in runs]
                assert s["per_seed"][str(point)] == truth
                assert s["mean"][s["points"].index(point)] == pytest.approx(stat(truth).mean)
            assert s["final"] == s["per_seed"][str(s["points"][-1])]
    # the diagnostics table: each run's first and last EDGE_STEPS rows, as logged (OPSD's teacher gain)
    from lopd.grid_report import EDGE_STEPS

    opsd = report["methods"]["opsd"]
    gains = [[r["context/teacher_gain_success"] for r in RunDir(p).read_metrics() if "context/teacher_gain_success" in r]
             for p in opsd["runs"]]
    assert opsd["diagnostics"]["context/teacher_gain_success"]["first"] == pytest.approx([sum(g[:EDGE_STEPS]) / len(g[:EDGE_STEPS]) for g in gains])
    assert opsd["diagnostics"]["context/teacher_gain_success"]["last"] == pytest.approx([sum(g[-EDGE_STEPS:]) / len(g[-EDGE_STEPS:]) for g in gains])
    assert "diagnostics" not in report["methods"]["grpo"] or not report["methods"]["grpo"]["diagnostics"]
    assert "## Training diagnostics" in (root / "report.md").read_text()
    assert "## Final success on every held-out split (%)" in (root / "report.md").read_text()  # test and transfer
    # the cost table: medians of the logged phase times, the largest peak RSS, the mean mixed-group share
    for method, entry in report["methods"].items():
        rows = RunDir(entry["runs"][0]).read_metrics()
        train_rows = [r for r in rows if "train" in r["kind"]]
        run0 = cost_of(all_cells[[str(c.path) for c in all_cells].index(entry["runs"][0])], grid.budget)
        assert run0["steps"] == len(train_rows) == grid.budget // 8
        assert run0["time/update"] == pytest.approx(statistics.median(r["time/update"] for r in train_rows))
        assert run0["time/step"] >= run0["time/rollout"] + run0["time/update"] > 0
        assert run0["time/eval"] == pytest.approx(statistics.median(r["time/eval"] for r in rows if "time/eval" in r))
        assert run0["memory/peak_rss_gib"] == max(r["memory/peak_rss_gib"] for r in rows)  # the step-0 eval's too
        for phase in ("rollout", "update", "eval"):  # each phase's own peak, below the process's
            assert 0 < run0[f"memory/peak_rss_gib/{phase}"] <= run0["memory/peak_rss_gib"]
        assert run0["reward/mixed_groups"] == pytest.approx(statistics.fmean(r["reward/mixed_groups"] for r in train_rows))
        runs = [cost_of(c, grid.budget) for c in all_cells if str(c.path) in entry["runs"]]
        assert entry["cost"]["time/update"] == pytest.approx(statistics.fmean(c["time/update"] for c in runs))
        assert entry["cost"]["memory/peak_rss_gib"] == max(c["memory/peak_rss_gib"] for c in runs)
    assert "## Cost and learning signal" in (root / "report.md").read_text()
    assert "| grpo |" in (root / "report.md").read_text()
    # a second call finds everything finished and only rewrites the report
    again = _compare(grid_file)
    assert again.returncode == 0 and "2 already finished" in again.stdout
    # a larger budget extends the finished runs (3 more steps each: both are still running after the first's
    # first new step); SIGTERM stops both, leaves none behind, and the same command finishes them
    longer = ["budget=32", "eval_every=32"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = zygote.Popen([sys.executable, "-m", "lopd.cli", "compare", "--config", str(grid_file), *longer],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, warm_children=True)
    first = all_cells[0]
    deadline = time.time() + 300
    while not any(r["rollouts"] > 8 and "train" in r.get("kind", "") for r in RunDir(first.path).read_metrics()):
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read()[-3000:] if proc.poll() else "slow"
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 130, out[-3000:]
    assert "interrupted: 2 run(s) stopped" in out
    for cell in all_cells:
        status = json.loads((cell.path / "status.json").read_text())
        assert status["state"] == "interrupted" and status["detail"] == "SIGTERM", status
        with pytest.raises(ProcessLookupError):  # no run left behind, orphaned
            os.kill(status["pid"], 0)
    done = _compare(grid_file, *longer)
    assert done.returncode == 0, done.stderr[-3000:]
    assert all(is_finished(load_grid(grid_file, longer), c) for c in all_cells)
    assert all((c.path / "finished").read_text().strip() == "32" for c in all_cells)
    assert all(max(r["rollouts"] for r in RunDir(c.path).read_metrics()) == 32 for c in all_cells)
    assert "previous process: interrupted" in (first.path / "resumes.log").read_text().splitlines()[-1]
    assert json.loads((root / "report.json").read_text())["methods"]["grpo"]["splits"]["test"]["points"][-1] == 32
    # the report at the old budget still reads the runs to it
    assert _compare(grid_file, "--report-only").returncode == 0
    again = json.loads((root / "report.json").read_text())
    assert {m: e["splits"] for m, e in again["methods"].items()} == {m: e["splits"] for m, e in report["methods"].items()}


def test_bad_grid_files_are_clear(tmp_path):
    path = tmp_path / "g.yaml"
    path.write_text("name: x\nbudget: 8\nseeds: [0]\nmethods: {grpo: {confg: a.yaml}}\n")
    with pytest.raises(ConfigError, match="method 'grpo': unknown key"):
        load_grid(path)
    path.write_text("name: x\nbudget: 8\nseeds: [0]\nmethods: {grpo: {overrides: [train.nope=1]}}\n")
    with pytest.raises(ConfigError, match="train.nope"):
        load_grid(path)
    path.write_text("name: x\nseeds: [0]\nmethods: {grpo: {}}\n")
    with pytest.raises(ConfigError, match="missing grid key 'budget'"):
        load_grid(path)


def test_stat_intervals_and_verdicts():
    from lopd.grid_report import compare_stats

    s = stat([0.5, 0.6, 0.7])
    assert s.mean == pytest.approx(0.6) and s.std == pytest.approx(0.1)
    half = 4.302652729911275 * 0.1 / 3 ** 0.5  # t(0.975, 2) * std / sqrt(n)
    assert s.low == pytest.approx(0.6 - half) and s.high == pytest.approx(0.6 + half)
    assert compare_stats(stat([0.9, 0.91, 0.92]), stat([0.1, 0.11, 0.12])) == "higher"
    assert compare_stats(stat([0.5, 0.6, 0.7]), stat([0.55, 0.65, 0.6])) == "no clear difference"
    assert compare_stats(stat([0.5]), stat([0.1])) is None and stat([0.31]).fmt() == "31.0 (1 seed)"


def test_eval_table_stacks_disjoint_category_splits_with_a_row_weighted_summary():
    from lopd.evaluation import EvalResult, category_table

    a = EvalResult("cat_a", 2, 0.5, 0.5, {"cat_a": (2, 0.5)}, modes={"official": 0.5, "strict": 0.0},
                   per_category_modes={"official": {"cat_a": 0.5}, "strict": {"cat_a": 0.0}})
    b = EvalResult("cat_b", 6, 1.0, 1.0, {"cat_b": (6, 1.0)}, modes={"official": 1.0, "strict": 0.5},
                   per_category_modes={"official": {"cat_b": 1.0}, "strict": {"cat_b": 0.5}})
    lines = category_table([a, b]).splitlines()
    assert lines[0] == "| category | n | official % | strict % |"
    assert lines[2] == "| cat_a | 2 | 50.0 | 0.0 |" and lines[3] == "| cat_b | 6 | 100.0 | 50.0 |"
    assert lines[4] == "| **all (weighted by rows)** | 8 | **87.5** | **37.5** |"  # (1 + 6) / 8, (0 + 3) / 8


def _entry(finals: list[float], ablation: bool = False) -> dict:
    """A report.json method entry with two budget points: 0.18 for every seed at 0, `finals` at 8."""
    points, per_seed = [0, 8], {"0": [0.18] * len(finals), "8": finals}
    return {"ablation": ablation, "runs": [f"runs/x/seed{i}" for i in range(len(finals))], "diagnostics": {},
            "splits": {"test": {"points": points, "mean": [stat(per_seed[str(p)]).mean for p in points],
                                "std": [stat(per_seed[str(p)]).std for p in points], "per_seed": per_seed,
                                "final": finals, "auc": [0.2] * len(finals)}}}


def test_merge_adds_recorded_methods_and_recomputes_the_verdicts():
    from lopd.grid_report import add_reference, merge_reports

    head = {"grid": "g", "budget": 8, "seeds": [0, 1, 2], "splits": ["test"]}
    not_run = _entry([])  # a method of the grid file whose runs are not on this machine: no point evaluated
    not_run["splits"]["test"]["points"] = []
    here = {**head, "methods": {"grpo": not_run, "lopd_no_margin": _entry([0.20, 0.21, 0.22], ablation=True)}}
    recorded = {**head, "provenance": {"command": "lopd compare ...", "commit": "abc1234", "config_hashes": {}},
                "methods": {"grpo": _entry([0.30, 0.31, 0.32]), "lopd_no_margin": _entry([0.9, 0.9, 0.9])}}
    merged = merge_reports(here, [("old/report.json", recorded)], "grpo")
    assert list(merged["methods"]) == ["grpo", "lopd_no_margin"]
    # the runs that are here win over a record of the same method
    assert merged["methods"]["lopd_no_margin"]["splits"]["test"]["final"] == [0.20, 0.21, 0.22]
    assert merged["merged_from"] == [{"report": "old/report.json", "methods": ["grpo"], "provenance": recorded["provenance"]}]
    s = merged["methods"]["lopd_no_margin"]["splits"]["test"]
    assert merged["reference"] == "grpo" and s["vs_reference"] == "lower" and s["rollouts_to_reference"] is None
    # the same verdicts as one report that held both methods from the start
    whole = add_reference({**head, "methods": {"grpo": _entry([0.30, 0.31, 0.32]),
                                               "lopd_no_margin": _entry([0.20, 0.21, 0.22], ablation=True)}}, "grpo")
    assert {m: e["splits"] for m, e in merged["methods"].items()} == {m: e["splits"] for m, e in whole["methods"].items()}
    with pytest.raises(ValueError, match=r"old/report.json: budget 16 differs from this grid's 8"):
        merge_reports(here, [("old/report.json", {**recorded, "budget": 16})], "grpo")
    from lopd.compare import Grid
    from lopd.grid_report import markdown

    merged["provenance"] = {"command": "lopd compare --merge old/report.json", "grid_file": "g.yaml", "commit": "def5678",
                            "machine": "m", "packages": {}, "config_hashes": {"runs/x/seed0": "00"}}
    md = markdown(Grid(name="g", budget=8, eval_every=8, seeds=[0, 1, 2], methods=[]), merged, [])
    assert "| grpo | 31.0 ± 1.0 |" in md and "| lopd_no_margin (ablation) | 21.0 ± 1.0 (lower) |" in md
    assert "- methods `grpo` taken from the recorded `old/report.json` (its command: `lopd compare ...`, lopd commit abc1234)" in md
    assert "held-out split" not in md  # one split: the summary already holds its final success


def test_a_run_not_here_is_left_out_of_its_methods_statistics_and_the_summary_says_so(tmp_path):
    from lopd.compare import Cell, Grid, Method
    from lopd.grid_report import markdown, summarise

    grpo, opsd = Method("grpo"), Method("opsd")
    grid = Grid(name="g", budget=8, eval_every=8, seeds=[0, 1, 2], methods=[grpo, opsd], out=str(tmp_path))
    cells = []
    finals = {("grpo", 0): 0.2, ("grpo", 1): 0.3, ("grpo", 2): 0.4, ("opsd", 1): 0.5, ("opsd", 2): 0.7}
    for m in (grpo, opsd):
        for seed in grid.seeds:
            path = tmp_path / m.name / f"seed{seed}"
            path.mkdir(parents=True)
            if (m.name, seed) in finals:  # opsd seed 0: its directory is empty (a run made elsewhere)
                rows = [{"kind": "eval", "step": 0, "rollouts": 0, "eval/test/success": 0.1},
                        {"kind": "train+eval", "step": 1, "rollouts": 8, "eval/test/success": finals[m.name, seed],
                         "time/update": 2.0 * seed}]
                (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            cells.append(Cell(m, seed, None, None, path))
    data = summarise(grid, cells)
    s = data["methods"]["opsd"]["splits"]["test"]
    assert s["seeds"] == 2 and s["points"] == [0, 8] and s["final"] == [0.5, 0.7]
    assert s["mean"][-1] == pytest.approx(0.6) and data["methods"]["grpo"]["splits"]["test"]["seeds"] == 3
    # its cost too: the mean of the runs that trained (update 2 s and 4 s), not diluted by the absent one
    assert data["methods"]["opsd"]["cost"]["steps"] == 1 and data["methods"]["opsd"]["cost"]["time/update"] == 3.0
    data["provenance"] = {"command": "c", "grid_file": "g.yaml", "commit": "x", "machine": "m", "packages": {},
                          "config_hashes": {}}
    md = markdown(grid, data, [])
    assert "| opsd (2 of 3 seeds) | 60.0 ± 14.1 (no clear difference) |" in md and "| grpo | 30.0 ± 10.0 |" in md
