"""The report of a `lopd compare` grid: report.md, report.json and figures, from the runs' metrics.jsonl.

Statistics: for every method, split and budget point, the mean over seeds, the sample std, and a 95%
confidence interval of the mean (Student t with n - 1 degrees of freedom). A method is called better or
worse than the reference only when the two intervals do not overlap; otherwise "no clear difference".
Every number in the tables is recomputed here from the rows of the runs' metrics.jsonl, nothing else.
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from lopd.compare import Cell, Grid
from lopd.runs import RunDir

DIAGNOSTICS = ["context/delta_success", "context/delta_failure", "context/margin_violation", "context/lambda"]
# the training diagnostics the report tabulates (where a method logs them): column title per metric
DIAGNOSTIC_TABLE = {
    "context/teacher_gain_success": "teacher gain, successes", "context/teacher_gain_failure": "teacher gain, failures",
    "context/delta_success": "Δ, successes", "context/delta_failure": "Δ, failures", "context/privilege": "A·Δ",
    "context/margin_violation": "margin violations", "context/gate": "gate tanh(g)", "context/coverage": "coverage",
    "context/retrieval_hit": "same-category hit", "context/retrieval_same_task": "same-task hit", "context/slot_cosine": "slot cosine",
}
EDGE_STEPS = 4  # diagnostics are compared between each run's first and last this many steps
# the loop's timed phases, in the order a step runs them (`time/*` in metrics.jsonl); eval is reported apart
PHASES = ["sync", "rollout", "score", "correct", "context", "update", "remember", "checkpoint"]
# the phases whose peak resident memory the cost table shows (`memory/peak_rss_gib/<phase>`, Linux)
PHASE_PEAKS = {f"memory/peak_rss_gib/{p}": f"{p} peak RSS GiB" for p in ("rollout", "update", "eval")}


@dataclass
class Stat:
    n: int
    mean: float
    std: float
    low: float
    high: float

    def fmt(self, scale: float = 100.0, digits: int = 1) -> str:
        if self.n == 0:
            return "-"
        if self.n == 1:
            return f"{scale * self.mean:.{digits}f} (1 seed)"
        return f"{scale * self.mean:.{digits}f} ± {scale * self.std:.{digits}f}"


def t_critical(df: int) -> float:
    from scipy.stats import t

    return float(t.ppf(0.975, df)) if df > 0 else math.inf


def stat(values: list[float]) -> Stat:
    n = len(values)
    if n == 0:
        return Stat(0, math.nan, math.nan, math.nan, math.nan)
    mean = statistics.fmean(values)
    std = statistics.stdev(values) if n > 1 else 0.0
    half = t_critical(n - 1) * std / math.sqrt(n) if n > 1 else math.inf
    return Stat(n, mean, std, mean - half, mean + half)


def compare_stats(a: Stat, b: Stat) -> str | None:
    """higher / lower / no clear difference, by non-overlapping 95% CIs; None with fewer than 2 seeds."""
    if a.n < 2 or b.n < 2:
        return None
    if a.low > b.high:
        return "higher"
    if a.high < b.low:
        return "lower"
    return "no clear difference"


def rows_of(cell: Cell, budget: int | None = None) -> list[dict]:
    """The run's metrics rows up to `budget` rollouts (a run extended past the grid's budget is read to it)."""
    return [r for r in RunDir(cell.path).read_metrics() if budget is None or r.get("rollouts", 0) <= budget]


def curves_of(cell: Cell, budget: int | None = None) -> dict[str, dict[int, float]]:
    """split -> {rollouts: success} for one run, up to `budget` rollouts."""
    out: dict[str, dict[int, float]] = {}
    for row in rows_of(cell, budget):
        for k, v in row.items():
            if k.startswith("eval/") and k.endswith("/success"):
                out.setdefault(k.split("/")[1], {})[row["rollouts"]] = v
    return out


def diagnostics_of(cell: Cell, budget: int | None = None) -> dict[str, tuple[float, float]]:
    """metric -> (mean over the run's first EDGE_STEPS training rows that log it, mean over its last, up to
    `budget` rollouts)."""
    out = {}
    rows = rows_of(cell, budget)
    for key in DIAGNOSTIC_TABLE:
        values = [r[key] for r in rows if key in r]
        if values:
            out[key] = (statistics.fmean(values[:EDGE_STEPS]), statistics.fmean(values[-EDGE_STEPS:]))
    return out


def cost_of(cell: Cell, budget: int | None = None) -> dict[str, float]:
    """What one run spent and what signal it had, from its training rows up to `budget` rollouts: the median
    seconds of each phase per step (`time/<phase>`), of a whole step (its phases summed) and of one evaluation;
    the largest peak memory any row recorded (RSS, per phase where logged, and GPU memory); the mean rollout success and
    share of groups with mixed rewards (the groups that carry an advantage); the number of steps."""
    rows = rows_of(cell, budget)
    train = [r for r in rows if "train" in r.get("kind", "")]
    out: dict[str, float] = {"steps": len(train)}
    for phase in PHASES:
        values = [r[f"time/{phase}"] for r in train if f"time/{phase}" in r]
        if values:
            out[f"time/{phase}"] = statistics.median(values)
    if train:
        out["time/step"] = statistics.median(sum(r.get(f"time/{p}", 0.0) for p in PHASES) for r in train)
    evals = [r["time/eval"] for r in rows if "time/eval" in r]
    if evals:
        out["time/eval"] = statistics.median(evals)
    for key in ("memory/peak_rss_gib", "memory/peak_gib", *PHASE_PEAKS):
        values = [r[key] for r in rows if key in r]
        if values:
            out[key] = max(values)
    for key in ("reward/success", "reward/mixed_groups"):
        values = [r[key] for r in train if key in r]
        if values:
            out[key] = statistics.fmean(values)
    return out


def method_key(cell: Cell) -> str:
    return "/".join([cell.method.name] + [p for p in (cell.backbone, cell.env) if p])


def summarise(grid: Grid, cells: list[Cell]) -> dict:
    """Everything the report shows, as plain data (also written as report.json)."""
    methods: dict[str, list[Cell]] = {}
    for c in cells:
        methods.setdefault(method_key(c), []).append(c)
    curves = {m: [curves_of(c, grid.budget) for c in cs] for m, cs in methods.items()}
    splits = sorted({s for runs in curves.values() for run in runs for s in run})
    out: dict = {"grid": grid.name, "budget": grid.budget, "seeds": grid.seeds, "splits": splits, "methods": {}}
    for m, runs in curves.items():
        entry: dict = {"ablation": methods[m][0].method.ablation, "runs": [str(c.path) for c in methods[m]], "splits": {}}
        for split in splits:
            evaluated = [r for r in runs if r.get(split)]  # a run not started (or whose record is elsewhere): left out
            points = sorted(set.intersection(*(set(r[split]) for r in evaluated))) if evaluated else []
            by_point = {p: [r[split][p] for r in evaluated] for p in points}
            aucs = [_auc(sorted(r[split].items()), grid.budget) for r in evaluated]
            entry["splits"][split] = {
                "seeds": len(evaluated),
                "points": points,
                "mean": [stat(by_point[p]).mean for p in points],
                "std": [stat(by_point[p]).std for p in points],
                "low": [stat(by_point[p]).low for p in points],
                "high": [stat(by_point[p]).high for p in points],
                "per_seed": {str(p): by_point[p] for p in points},
                "final": by_point[points[-1]] if points else [],
                "auc": aucs,
            }
        diagnostics = [diagnostics_of(c, grid.budget) for c in methods[m]]
        entry["diagnostics"] = {key: {"first": [d[key][0] for d in diagnostics if key in d],
                                      "last": [d[key][1] for d in diagnostics if key in d]}
                                for key in DIAGNOSTIC_TABLE if any(key in d for d in diagnostics)}
        costs = [c for c in (cost_of(c, grid.budget) for c in methods[m]) if c["steps"]]  # runs that trained here
        # over seeds: the mean of each run's medians and means, the largest peak
        entry["cost"] = {key: (max if key.startswith("memory/") else statistics.fmean)([c[key] for c in costs if key in c])
                         for key in dict.fromkeys(k for c in costs for k in c)}
        out["methods"][m] = entry
    return add_reference(out, grid.reference)


def add_reference(out: dict, reference: str) -> dict:
    """Set every method's "rollouts to the reference's final" and its verdict against the reference."""
    ref_key = next((m for m in out["methods"] if m.split("/")[0] == reference), None)
    out["reference"] = ref_key
    for m, entry in out["methods"].items():
        for split, s in entry["splits"].items():
            s["rollouts_to_reference"] = _rollouts_to(s, out["methods"][ref_key]["splits"].get(split)) if ref_key else None
            s["vs_reference"] = (compare_stats(stat(s["final"]), stat(out["methods"][ref_key]["splits"][split]["final"]))
                                 if ref_key and m != ref_key and split in out["methods"][ref_key]["splits"] else None)
    return out


def merge_reports(data: dict, recorded: list[tuple[str, dict]], reference: str) -> dict:
    """`data` (this grid's runs) with the methods of recorded report.json files added, for methods whose runs
    are not here (made on a machine since gone). Every report must share the budget, seeds and splits, so
    that the merged table compares equal budgets; a method with an evaluated point in this grid's runs is
    never taken from a record. Raises ValueError naming the file and the key that differs."""
    here = {m: e for m, e in data["methods"].items() if any(sp["points"] for sp in e["splits"].values())}
    out = {**data, "methods": {}, "merged_from": []}
    for path, rec in recorded:
        for key in ("budget", "seeds", "splits"):
            if rec.get(key) != data.get(key):
                raise ValueError(f"{path}: {key} {rec.get(key)} differs from this grid's {data.get(key)}")
        taken = [m for m in rec["methods"] if m not in here and m not in out["methods"]]
        out["methods"].update({m: rec["methods"][m] for m in taken})
        out["merged_from"].append({"report": path, "methods": taken, "provenance": rec.get("provenance", {})})
    if "provenance" in data:  # the taken methods' runs are listed under their record, not as missing here
        gone = {r for m in out["methods"] for r in data["methods"].get(m, {}).get("runs", [])}
        hashes = data["provenance"]["config_hashes"]
        out["provenance"] = {**data["provenance"], "config_hashes": {r: h for r, h in hashes.items() if r not in gone}}
    out["methods"].update({m: e for m, e in data["methods"].items() if m not in out["methods"]})
    return add_reference(out, reference)


def _auc(points: list[tuple[int, float]], budget: int) -> float:
    """Mean success over the budget: trapezoid area under success-vs-rollouts divided by the budget."""
    if len(points) < 2:
        return points[0][1] if points else math.nan
    area = sum((x1 - x0) * (y0 + y1) / 2 for (x0, y0), (x1, y1) in zip(points, points[1:]))
    return area / max(points[-1][0] - points[0][0], 1)


def _rollouts_to(s: dict, ref: dict | None) -> float | None:
    """Rollouts at which the seed-mean curve first reaches the reference's final mean success, as a
    fraction of the reference's budget (None: never reached)."""
    if not ref or not ref["points"] or not s["points"]:
        return None
    target = ref["mean"][-1]
    for p, m in zip(s["points"], s["mean"]):
        if m >= target - 1e-12:
            return p / ref["points"][-1]
    return None


# ------------------------------------------------------------------------------- writing


def write_grid_report(grid: Grid, cells: list[Cell], command: str = "", merge: list[str] = ()) -> Path:
    """report.md, report.json and figures under the grid's root. `merge`: recorded report.json files whose
    methods (runs not on this machine) join the tables and the curves; the diagnostics figure, drawn from
    the runs' own rows, is then left out (the records' diagnostics stay in the table)."""
    data = summarise(grid, cells)
    data["provenance"] = provenance(grid, cells, command)
    if merge:
        data = merge_reports(data, [(str(p), json.loads(Path(p).read_text())) for p in merge], grid.reference)
    root = grid.root
    root.mkdir(parents=True, exist_ok=True)
    figures = plot_grid(data, root, diagnostics=not merge)
    (root / "report.json").write_text(json.dumps(data, indent=1, default=float))
    (root / "report.md").write_text(markdown(grid, data, figures))
    return root / "report.md"


def main_table(data: dict) -> str:
    splits = data["splits"]
    ref = data["reference"]
    lines = ["| method | " + " | ".join(f"{s}: final % | {s}: AUC % | {s}: rollouts to {ref or '-'} final" for s in splits) + " |",
             "|---|" + "---:|---:|---:|" * len(splits)]
    for m, e in data["methods"].items():
        cells = []
        for s in splits:
            sp = e["splits"].get(s)
            if not sp:
                cells += ["-", "-", "-"]
                continue
            r = sp["rollouts_to_reference"]
            verdict = f" ({sp['vs_reference']})" if sp.get("vs_reference") else ""
            ref_split = data["methods"][ref]["splits"].get(s) if ref else None
            no_gain = bool(ref_split and ref_split["mean"] and ref_split["mean"][-1] <= ref_split["mean"][0])
            cells += [stat(sp["final"]).fmt() + verdict, stat(sp["auc"]).fmt(),
                      f"n/a ({ref} ends at or below its start)" if no_gain
                      else "not reached" if r is None else f"{100 * r:.0f}% of budget"]
        seeds = min((sp.get("seeds", len(data["seeds"])) for sp in e["splits"].values()), default=0)
        fewer = f" ({seeds} of {len(data['seeds'])} seeds)" if seeds < len(data["seeds"]) else ""
        lines.append(f"| {m}{' (ablation)' if e['ablation'] else ''}{fewer} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def budget_table(data: dict, split: str) -> str:
    methods = [m for m, e in data["methods"].items() if split in e["splits"]]
    points = sorted({p for m in methods for p in data["methods"][m]["splits"][split]["points"]})
    lines = ["| rollouts | " + " | ".join(methods) + " |", "|---:|" + "---:|" * len(methods)]
    for p in points:
        row = []
        for m in methods:
            sp = data["methods"][m]["splits"][split]
            vals = sp["per_seed"].get(str(p))
            row.append(stat(vals).fmt() if vals else "-")
        lines.append(f"| {p} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def diagnostics_table(data: dict) -> str | None:
    """Seed means of each method's diagnostics, first steps -> last steps; None when no method logs any."""
    keys = [k for k in DIAGNOSTIC_TABLE if any(k in e.get("diagnostics", {}) for e in data["methods"].values())]
    if not keys:
        return None
    lines = ["| method | " + " | ".join(DIAGNOSTIC_TABLE[k] for k in keys) + " |", "|---|" + "---:|" * len(keys)]
    for m, e in data["methods"].items():
        d = e.get("diagnostics", {})
        if not d:
            continue
        cells = [f"{statistics.fmean(d[k]['first']):+.3f} → {statistics.fmean(d[k]['last']):+.3f}" if k in d else "-"
                 for k in keys]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cost_table(data: dict) -> str | None:
    """Per method: median seconds per phase, step and evaluation, peak memory, and the learning signal the
    rollouts carried; None when no method has training rows (e.g. every run recorded elsewhere)."""
    costs = {m: e["cost"] for m, e in data["methods"].items() if e.get("cost", {}).get("steps")}
    if not costs:
        return None
    present = lambda key: any(key in c for c in costs.values())  # noqa: E731
    columns = [("steps", "steps", "{:.0f}")]
    columns += [(f"time/{p}", f"{p} s", "{:.1f}") for p in PHASES if present(f"time/{p}")]
    columns += [("time/step", "step s", "{:.1f}"), ("time/eval", "eval s", "{:.1f}"),
                ("memory/peak_rss_gib", "peak RSS GiB", "{:.1f}"),
                *[(key, title, "{:.1f}") for key, title in PHASE_PEAKS.items()], ("memory/peak_gib", "peak GPU GiB", "{:.1f}"),
                ("reward/success", "rollout success %", "{:.1%}"), ("reward/mixed_groups", "mixed groups %", "{:.1%}")]
    columns = [c for c in columns if present(c[0])]
    lines = ["| method | " + " | ".join(title for _, title, _ in columns) + " |", "|---|" + "---:|" * len(columns)]
    for m, c in costs.items():
        cells = [fmt.format(c[key]).rstrip("%") if key in c else "-" for key, _, fmt in columns]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown(grid: Grid, data: dict, figures: list[str]) -> str:
    prov = data["provenance"]
    n_seeds = len(grid.seeds)
    out = [f"# `lopd compare`: {grid.name}", "",
           f"Held-out success of the student alone (greedy, no context), {n_seeds} seed(s) per method, every run "
           f"under the same budget of {grid.budget} sampled trajectories, evaluated at the same budget points. "
           f"Cells are mean ± std over seeds (in %). A method is called higher/lower than `{data['reference']}` "
           f"only when the 95% confidence intervals of the means (Student t) do not overlap.", ""]
    for f in figures:
        out += [f"![{f}]({f})", ""]
    out += ["## Summary", "", main_table(data), ""]
    for split in data["splits"]:
        out += [f"## Success (%) at each budget point: `{split}`", "", budget_table(data, split), ""]
    ablations = {m: e for m, e in data["methods"].items() if e["ablation"]}
    if ablations:
        full = [m for m, e in data["methods"].items() if m.split("/")[0] == "lopd"]
        out += ["## Ablations (final success, %)", "",
                "| method | " + " | ".join(data["splits"]) + " |", "|---|" + "---:|" * len(data["splits"])]
        for m in full + list(ablations):
            e = data["methods"][m]
            out.append(f"| {m} | " + " | ".join(stat(e["splits"][s]["final"]).fmt() if s in e["splits"] else "-"
                                                 for s in data["splits"]) + " |")
        out.append("")
    table = diagnostics_table(data)
    if table:
        out += ["## Training diagnostics", "",
                f"Mean over seeds of each run's first {EDGE_STEPS} steps → its last {EDGE_STEPS} (nats/token for the "
                "gains; Δ is the latent teacher's log-likelihood gain over the context-free model, the teacher gain "
                "the teacher's over the student, on the student's own successful and failed trajectories).", "",
                table, ""]
    table = cost_table(data)
    if table:
        out += ["## Cost and learning signal", "",
                "Median wall seconds per training step of each timed phase and of the whole step, median seconds per "
                "evaluation, the largest peak memory recorded, the mean share of rollouts that succeeded and of groups "
                "whose rewards differ (only those carry an advantage); runs' figures are averaged over seeds. Times "
                "are only comparable between runs that had the machine to themselves.", "", table, ""]
    if len(data["splits"]) > 1:  # with one held-out split this is the summary's first column again
        out += ["## Final success on every held-out split (%)", "",
                "Trained on the `train` split; what each held-out split holds is the env's (ToolWorld: `test` new "
                "requests to the training tools, `transfer` tools never trained on).", "",
                "| method | " + " | ".join(data["splits"]) + " |", "|---|" + "---:|" * len(data["splits"])]
        for m, e in data["methods"].items():
            out.append(f"| {m} | " + " | ".join(stat(e["splits"][s]["final"]).fmt() if s in e["splits"] else "-"
                                                 for s in data["splits"]) + " |")
        out.append("")
    out += ["## Provenance", "", f"- command: `{prov['command']}`", f"- grid file: `{prov['grid_file']}`",
            f"- machine: {prov['machine']}", f"- lopd commit: {prov['commit']}",
            "- packages: " + ", ".join(f"{k} {v}" for k, v in prov["packages"].items()), "- runs (config sha256):"]
    out += [f"  - `{run}`: {h}" for run, h in prov["config_hashes"].items()]
    for src in data.get("merged_from", []):
        p = src["provenance"]
        out += [f"- methods {', '.join(f'`{m}`' for m in src['methods'])} taken from the recorded `{src['report']}` "
                f"(its command: `{p.get('command', '?')}`, lopd commit {p.get('commit', '?')}); its runs (config sha256):"]
        out += [f"  - `{run}`: {h}" for run, h in p.get("config_hashes", {}).items()]
    return "\n".join(out) + "\n"


def provenance(grid: Grid, cells: list[Cell], command: str) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    packages = {}
    for name in ("lopd", "torch", "transformers", "peft", "sentence-transformers", "numpy"):
        try:
            packages[name] = version(name)
        except PackageNotFoundError:
            packages[name] = "not installed"
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip() or "unknown"
    except OSError:
        commit = "unknown"
    import os

    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    hashes = {}
    for c in cells:
        cfg = RunDir(c.path).config_path
        hashes[str(c.path)] = hashlib.sha256(cfg.read_bytes()).hexdigest()[:16] if cfg.is_file() else "missing"
    return {"command": command or " ".join(sys.argv), "grid_file": grid.source, "commit": commit,
            "machine": f"{platform.platform()}, {os.cpu_count()} CPUs, {gpu}, Python {platform.python_version()}",
            "packages": packages, "config_hashes": hashes}


def plot_grid(data: dict, root: Path, diagnostics: bool = True) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    splits = data["splits"]
    fig, axes = plt.subplots(1, max(len(splits), 1), figsize=(5.5 * max(len(splits), 1), 4.2), squeeze=False,
                             constrained_layout=True)
    colors = plt.get_cmap("tab10")
    top = max([100 * (m + d) for e in data["methods"].values() for sp in e["splits"].values()
               for m, d in zip(sp["mean"], sp["std"])] + [10])
    for ax, split in zip(axes[0], splits):
        for i, (m, e) in enumerate(data["methods"].items()):
            sp = e["splits"].get(split)
            if not sp or not sp["points"]:
                continue
            mean = [100 * v for v in sp["mean"]]
            std = [100 * v for v in sp["std"]]
            style = "--" if e["ablation"] else "-"
            seeds = sp.get("seeds", len(data["seeds"]))
            label = m + (f" ({seeds} of {len(data['seeds'])} seeds)" if seeds < len(data["seeds"]) else "")
            ax.plot(sp["points"], mean, style, marker="o", ms=3, color=colors(i % 10), label=label)
            ax.fill_between(sp["points"], [a - b for a, b in zip(mean, std)], [a + b for a, b in zip(mean, std)],
                            color=colors(i % 10), alpha=0.15, linewidth=0)
        ax.set(title=f"held-out: {split}", xlabel="rollouts (sampled trajectories)", ylabel="success (%), mean ± std",
               ylim=(0, min(100, 10 * math.ceil(top / 10 + 0.5))))
        ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside right upper", fontsize=8)
    fig.savefig(root / "curves.png", dpi=120)
    plt.close(fig)
    figures = ["curves.png"]
    if diagnostics and _plot_diagnostics(data, root):
        figures.append("diagnostics.png")
    return figures


def _plot_diagnostics(data: dict, root: Path) -> bool:
    import matplotlib.pyplot as plt

    runs = [(m, Path(r)) for m, e in data["methods"].items() for r in e["runs"]]
    series = {(m, key): [] for m, _ in runs for key in DIAGNOSTICS}
    for m, path in runs:
        for key in DIAGNOSTICS:
            pts = [(r["rollouts"], r[key]) for r in RunDir(path).read_metrics()
                   if key in r and r["rollouts"] <= data["budget"]]
            if pts:
                series[(m, key)].append(pts)
    if not any(series.values()):
        return False
    fig, axes = plt.subplots(1, len(DIAGNOSTICS), figsize=(4.5 * len(DIAGNOSTICS), 3.8), constrained_layout=True)
    titles = {"context/delta_success": "Δ on successes (nats/token)", "context/delta_failure": "Δ on failures (nats/token)",
              "context/margin_violation": "margin violation rate", "context/lambda": "λ (margin weight)"}
    colors = plt.get_cmap("tab10")
    methods = list(data["methods"])
    for ax, key in zip(axes, DIAGNOSTICS):
        for m in methods:
            for j, pts in enumerate(series.get((m, key), [])):
                xs, ys = zip(*pts)
                ax.plot(xs, ys, color=colors(methods.index(m) % 10), alpha=0.7, label=m if j == 0 else None)
        ax.set(title=titles[key], xlabel="rollouts")
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside right upper", fontsize=8)
    fig.savefig(root / "diagnostics.png", dpi=120)
    plt.close(fig)
    return True
