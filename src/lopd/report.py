"""Reports of a run: a markdown table of held-out success against rollouts, and the curves as a PNG.

Numbers come straight from metrics.jsonl; nothing is smoothed or re-computed.
"""

from __future__ import annotations

from pathlib import Path

from lopd.runs import RunDir


def eval_rows(metrics: list[dict]) -> list[dict]:
    return [r for r in metrics if any(k.startswith("eval/") for k in r)]


def eval_splits(rows: list[dict]) -> list[str]:
    seen: list[str] = []
    for r in rows:
        for k in r:
            if k.startswith("eval/") and k.endswith("/success") and (s := k.split("/")[1]) not in seen:
                seen.append(s)
    return seen


def success_table(metrics: list[dict]) -> str:
    rows = eval_rows(metrics)
    splits = eval_splits(rows)
    out = ["| step | rollouts | tokens | " + " | ".join(f"{s} success (%)" for s in splits) + " |",
           "|---:|---:|---:|" + "---:|" * len(splits)]
    for r in rows:
        cells = [f"{100 * r[f'eval/{s}/success']:.1f}" if f"eval/{s}/success" in r else "-" for s in splits]
        out.append(f"| {r['step']} | {r['rollouts']} | {r['tokens']} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def _fitted(values: list[float], floor: float = 0.0) -> tuple[float, float]:
    """A y range around the data with a little room, so a gain of a few points is visible."""
    lo, hi = min(values), max(values)
    pad = max(2.0, 0.15 * (hi - lo))
    return max(floor, lo - pad), hi + pad


def plot_curves(metrics: list[dict], path: Path, title: str = "") -> None:
    """Four panels: held-out success, training-batch success, the loss terms, seconds per phase."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = eval_rows(metrics)
    train = [r for r in metrics if "reward/success" in r]
    fig, axes = plt.subplots(1, 4, figsize=(20, 4), constrained_layout=True)
    ax1, ax2, ax3, ax4 = axes
    seen: list[float] = []
    for split in eval_splits(rows):
        pts = [(r["rollouts"], 100 * r[f"eval/{split}/success"]) for r in rows if f"eval/{split}/success" in r]
        ax1.plot(*zip(*pts), marker="o", label=split)
        seen += [y for _, y in pts]
    ax1.set(xlabel="rollouts (sampled trajectories)", ylabel="held-out success (%)", title="Held-out success (greedy)")
    if seen:
        ax1.set_ylim(*_fitted(seen))
        ax1.legend()
    if train:
        xs = [r["rollouts"] for r in train]
        ys = [100 * r["reward/success"] for r in train]
        ax2.plot(xs, ys, alpha=0.8, label="train batch success")
        ax2.set_ylim(*_fitted(ys))
        ax2.legend()
        for key in sorted({k for r in train for k in r if k.startswith("loss/") and k != "loss/clip_frac"}):
            pts = [(r["rollouts"], r[key]) for r in train if key in r]
            ax3.plot(*zip(*pts), label=key.removeprefix("loss/"))
        if ax3.lines:
            ax3.legend(fontsize=8)
        phases = sorted({k for r in train for k in r if k.startswith("time/")})
        bottom = [0.0] * len(train)
        for key in phases:
            vals = [r.get(key, 0.0) for r in train]
            ax4.bar(range(1, len(train) + 1), vals, bottom=bottom, label=key.removeprefix("time/"))
            bottom = [b + v for b, v in zip(bottom, vals)]
        if phases:
            ax4.legend(fontsize=8)
    ax2.set(xlabel="rollouts (sampled trajectories)", ylabel="success of sampled rollouts (%)", title="Training rollouts")
    ax3.set(xlabel="rollouts (sampled trajectories)", ylabel="loss", title="Loss terms")
    ax4.set(xlabel="step", ylabel="seconds", title="Time per step, by phase")
    for ax in axes:
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def health_line(rows: list[dict], run: RunDir) -> str:
    """Optimizer steps skipped for a non-finite loss or gradient, and how often the run was resumed."""
    skipped = sum(r.get("health/skipped_steps", 0) for r in rows)
    losses = sum(r.get("health/nonfinite_losses", 0) for r in rows)
    resumes = len(run.resumes_path.read_text().splitlines()) if run.resumes_path.is_file() else 0
    return (f"Health: {skipped:.0f} optimizer step(s) skipped for a non-finite loss or gradient "
            f"({losses:.0f} non-finite micro-batch loss(es)); resumed {resumes} time(s) (resumes.log).")


def write_run_report(path: str | Path) -> Path:
    run = RunDir(path)
    metrics = run.read_metrics()
    title = run.path.name
    plot_curves(metrics, run.curves_path, title)
    timing = [r for r in metrics if r.get("kind", "").startswith("train")]
    phases = sorted({k for r in timing for k in r if k.startswith("time/")})
    time_lines = [f"| {p.removeprefix('time/')} | {sum(r.get(p, 0.0) for r in timing) / max(len(timing), 1):.2f} |"
                  for p in phases]
    text = "\n".join([
        f"# Run `{title}`", "",
        "Held-out success of the student alone (greedy decoding, no context) against the rollout budget.", "",
        success_table(metrics), "",
        f"![curves]({run.curves_path.name})", "",
        "Mean seconds per training step, by phase:", "",
        "| phase | seconds |", "|---|---:|", *time_lines, "",
        health_line(timing, run), "",
        f"Config: `{run.config_path.name}`; every number above is a row of `{run.metrics_path.name}`.", ""])
    run.report_path.write_text(text)
    return run.report_path
