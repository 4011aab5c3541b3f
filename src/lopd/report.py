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


LOSS_TERMS = ("loss/pg", "loss/distill", "loss/margin", "loss/kl_ref")  # what the update minimises, one panel each
DIAGNOSTICS = ("loss/ratio", "loss/clip_frac")  # the PPO ratio (~1 on-policy) and its clipped share: a small panel


def _line(ax, pts: list[tuple[float, float]], **kw) -> None:
    """A curve through `pts`, with markers while there are few enough points to see them."""
    if pts:
        ax.plot(*zip(*pts), marker="o" if len(pts) <= 30 else None, ms=4, **kw)


def _series(rows: list[dict], key: str, scale: float = 1.0) -> list[tuple[float, float]]:
    return [(r["rollouts"], scale * r[key]) for r in rows if key in r]


def _plot_success(ax, rows: list[dict]) -> None:
    seen = []
    for split in eval_splits(rows):
        pts = _series(rows, f"eval/{split}/success", 100.0)
        _line(ax, pts, label=split)
        seen += [y for _, y in pts]
    if seen:
        ax.set_ylim(*_fitted(seen))
        ax.legend(title="split")
    ax.set(xlabel="rollouts (sampled trajectories)", ylabel="success (%)", title="Held-out success (greedy, student alone)")


def _plot_reward(ax, train: list[dict]) -> None:
    _line(ax, _series(train, "reward/mean"), label="mean reward")
    if any(r.get("reward/success") != r.get("reward/mean") for r in train):  # partial rewards: success differs
        _line(ax, _series(train, "reward/success"), label="success rate", ls="--")
        ax.legend()
    ax.set_ylim(-0.05, 1.05)
    ax.set(xlabel="rollouts (sampled trajectories)", ylabel="reward (batch mean)", title="Training rollouts")


def _plot_time(ax, train: list[dict]) -> None:
    bottom = [0.0] * len(train)
    for key in sorted({k for r in train for k in r if k.startswith("time/")}):
        vals = [r.get(key, 0.0) for r in train]
        ax.bar([r["step"] for r in train], vals, bottom=bottom, label=key.removeprefix("time/"))
        bottom = [b + v for b, v in zip(bottom, vals)]
    if ax.patches:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # beside the bars, never over them
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set(xlabel="step", ylabel="seconds", title="Time per step, by phase")


def plot_curves(metrics: list[dict], path: Path, title: str = "") -> None:
    """curves.png of a run (`curves_figure`)."""
    import matplotlib.pyplot as plt

    fig = curves_figure(metrics, title)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def curves_figure(metrics: list[dict], title: str = ""):
    """Top row: held-out success, the training batches' reward, seconds per phase. Bottom row: each loss term
    on its own axes (their scales differ by orders of magnitude), then the PPO ratio and clip fraction on a
    small axis of their own (the ratio sits at ~1 and would flatten the losses)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in metrics if "reward/mean" in r]
    losses = [k for k in LOSS_TERMS if any(k in r for r in train)] or ["loss/pg"]
    diagnostics = [k for k in DIAGNOSTICS if any(k in r for r in train)]
    # fixed margins (a layout engine doubles the drawing time of every run's report): the top row leaves room on
    # the right for the phases' legend, which stands beside its bars
    fig = plt.figure(figsize=(16, 8))
    high = 0.91 if title else 0.94
    top = fig.add_gridspec(1, 3, left=0.045, right=0.915, top=high, bottom=0.57, wspace=0.2)
    ax1, ax2, ax3 = (fig.add_subplot(top[0, i]) for i in range(3))
    _plot_success(ax1, eval_rows(metrics))
    _plot_reward(ax2, train)
    _plot_time(ax3, train)
    panels = len(losses) + bool(diagnostics)
    bottom = fig.add_gridspec(1, panels, left=0.045, right=0.985, top=0.44, bottom=0.07, wspace=0.28,
                              width_ratios=[1.0] * len(losses) + [0.6] * bool(diagnostics))
    axes = [fig.add_subplot(bottom[0, i]) for i in range(panels)]
    for ax, key in zip(axes, losses):
        _line(ax, _series(train, key))
        ax.set(xlabel="rollouts (sampled trajectories)", ylabel=key.removeprefix("loss/"),
               title=f"Loss term: {key.removeprefix('loss/')}")
    if diagnostics:
        for key in diagnostics:
            _line(axes[-1], _series(train, key), label=key.removeprefix("loss/"))
        axes[-1].legend(fontsize=8)
        axes[-1].set(xlabel="rollouts", ylabel="ratio, fraction", title="PPO ratio, clip fraction")
    for ax in [ax1, ax2, ax3, *axes]:
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    return fig


FLAT_CAUSES = ("likely causes: the policy scores the same on every rollout (a model that does not know the task's "
               "format: docs/own_env.md says what the bundled models know), a reward that is constant, or "
               "rollout.group_size=1")


def trailing_flat(rows: list[dict]) -> list[int]:
    """The latest training steps in a row in which no group's rewards differed (`reward/mixed_groups` = 0):
    the advantages are 0 there, so the policy gradient has nothing to learn from."""
    steps: list[int] = []
    for r in rows:
        if "reward/mixed_groups" in r:
            steps = steps + [r["step"]] if r["reward/mixed_groups"] == 0 else []
    return steps


def flat_streak(rows: list[dict]) -> list[int]:
    """The longest run of consecutive training steps without reward variance (`flat_steps`), the last one
    among equals."""
    train = [r for r in rows if "reward/mixed_groups" in r]
    best: list[int] = []
    current: list[int] = []
    for r in train:
        current = current + [r["step"]] if r["reward/mixed_groups"] == 0 else []
        if current and len(current) >= len(best):
            best = current
    return best


def flat_message(steps: list[int]) -> str:
    """One line: which steps had no reward variance, what that means, and the likely causes."""
    where = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
    return (f"{where}: no group had any reward variance (reward/mixed_groups = 0), so every advantage is 0 and "
            f"the policy gradient had no signal; {FLAT_CAUSES}")


def signal_line(rows: list[dict], warn_after: int) -> str:
    """The run's learning signal in one line: the mean share of groups whose rewards differed, and a warning
    when `warn_after` (train.flat_reward_steps) or more steps in a row had none."""
    mixed = [r["reward/mixed_groups"] for r in rows if "reward/mixed_groups" in r]
    if not mixed:
        return "Learning signal: no training step yet."
    share = f"Learning signal: {100 * sum(mixed) / len(mixed):.0f}% of groups had reward variance (mean over steps)."
    streak = flat_streak(rows)
    if warn_after and len(streak) >= warn_after:
        return f"{share} **Warning**: {flat_message(streak)}."
    return share


def memory_cells(rows: list[dict], phase: str) -> str:
    """The highest peak resident memory of a phase over the run's rows, in GiB ("-" if not measured)."""
    peaks = [r[f"memory/peak_rss_gib/{phase}"] for r in rows if f"memory/peak_rss_gib/{phase}" in r]
    return f"{max(peaks):.2f}" if peaks else "-"


def memory_line(rows: list[dict]) -> str:
    """The process's peak resident memory over the run (the kernel's peak-RSS mark, `memory/peak_rss_gib`),
    and the GPU's peak allocation if there was one."""
    rss = [r["memory/peak_rss_gib"] for r in rows if "memory/peak_rss_gib" in r]
    gpu = [r["memory/peak_gib"] for r in rows if "memory/peak_gib" in r]
    if not rss:
        return "Peak memory: not measured."
    out = f"Peak memory: {max(rss):.2f} GiB resident (memory/peak_rss_gib; what `/usr/bin/time -v` reports)"
    return out + (f", {max(gpu):.2f} GiB on the GPU (memory/peak_gib)." if gpu else ".")


def health_line(rows: list[dict], run: RunDir) -> str:
    """Optimizer steps skipped for a non-finite loss or gradient, and how often the run was resumed."""
    skipped = sum(r.get("health/skipped_steps", 0) for r in rows)
    losses = sum(r.get("health/nonfinite_losses", 0) for r in rows)
    resumes = len(run.resumes_path.read_text().splitlines()) if run.resumes_path.is_file() else 0
    return (f"Health: {skipped:.0f} optimizer step(s) skipped for a non-finite loss or gradient "
            f"({losses:.0f} non-finite micro-batch loss(es)); resumed {resumes} time(s) (resumes.log).")


def write_run_report(path: str | Path, flat_reward_steps: int = 3) -> Path:
    """report.md and curves.png of a run, from its metrics.jsonl. `flat_reward_steps`: how many steps in a
    row without reward variance earn a warning line (train.flat_reward_steps; 0 = never)."""
    from lopd.runs import one_line_write_errors

    run = RunDir(path)
    metrics = run.read_metrics()
    title = run.path.name
    with one_line_write_errors(run.curves_path):
        plot_curves(metrics, run.curves_path, title)
    timing = [r for r in metrics if r.get("kind", "").startswith("train")]
    phases = sorted({k for r in timing for k in r if k.startswith("time/")})
    time_lines = [f"| {p.removeprefix('time/')} | {sum(r.get(p, 0.0) for r in timing) / max(len(timing), 1):.2f} | "
                  f"{memory_cells(metrics, p.removeprefix('time/'))} |" for p in phases]
    text = "\n".join([
        f"# Run `{title}`", "",
        "Held-out success of the student alone (greedy decoding, no context) against the rollout budget.", "",
        success_table(metrics), "",
        f"![curves]({run.curves_path.name})", "",
        "Mean seconds per training step and the highest peak resident memory, by phase:", "",
        "| phase | seconds | peak RSS (GiB) |", "|---|---:|---:|", *time_lines, "",
        memory_line(metrics), "",
        signal_line(timing, flat_reward_steps), "",
        health_line(timing, run), "",
        f"Config: `{run.config_path.name}`; every number above is a row of `{run.metrics_path.name}`.", ""])
    with one_line_write_errors(run.report_path):
        run.report_path.write_text(text)
    return run.report_path
