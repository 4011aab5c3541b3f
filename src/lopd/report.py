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


def plot_curves(metrics: list[dict], path: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = eval_rows(metrics)
    train = [r for r in metrics if "reward/success" in r]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    for split in eval_splits(rows):
        pts = [(r["rollouts"], 100 * r[f"eval/{split}/success"]) for r in rows if f"eval/{split}/success" in r]
        ax1.plot(*zip(*pts), marker="o", label=split)
    ax1.set(xlabel="rollouts (sampled trajectories)", ylabel="held-out success (%)", title="Held-out success (greedy)",
            ylim=(0, 100))
    ax1.grid(alpha=0.3)
    ax1.legend()
    if train:
        ax2.plot([r["rollouts"] for r in train], [100 * r["reward/success"] for r in train], alpha=0.8,
                 label="train batch success")
        ax2.set(xlabel="rollouts (sampled trajectories)", ylabel="success of sampled rollouts (%)",
                title="Training rollouts", ylim=(0, 100))
        ax2.grid(alpha=0.3)
        ax2.legend()
    if title:
        fig.suptitle(title)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_run_report(path: str | Path) -> Path:
    run = RunDir(path)
    metrics = run.read_metrics()
    title = run.path.name
    plot_curves(metrics, run.path / "curves.png", title)
    timing = [r for r in metrics if r.get("kind", "").startswith("train")]
    phases = sorted({k for r in timing for k in r if k.startswith("time/")})
    time_lines = [f"| {p.removeprefix('time/')} | {sum(r.get(p, 0.0) for r in timing) / max(len(timing), 1):.2f} |"
                  for p in phases]
    text = "\n".join([
        f"# Run `{title}`", "",
        "Held-out success of the student alone (greedy decoding, no context) against the rollout budget.", "",
        success_table(metrics), "",
        "![curves](curves.png)", "",
        "Mean seconds per training step, by phase:", "",
        "| phase | seconds |", "|---|---:|", *time_lines, "",
        f"Config: `{run.config_path.name}`; every number above is a row of `{run.metrics_path.name}`.", ""])
    (run.path / "report.md").write_text(text)
    return run.path / "report.md"
