"""The two pictures of a run, read as a reader would: curves.png (report.curves_figure) and inspect.png
(inspection.inspect_figure). Built from hand-made metrics and slots; the checks are on the drawn figure."""

from types import SimpleNamespace

import pytest
import torch

from lopd.inspection import MAX_SLOT_ROWS, X_LABELS, inspect_figure
from lopd.report import curves_figure


def _metrics(steps: int = 6) -> list[dict]:
    rows = [{"step": 0, "rollouts": 0, "tokens": 0, "kind": "eval", "eval/test/success": 0.10}]
    for s in range(1, steps + 1):
        rows.append({"step": s, "rollouts": 16 * s, "tokens": 400 * s, "kind": "train", "reward/mean": 0.1 * s,
                     "reward/success": 0.1 * s, "loss/pg": 0.002 * (-1) ** s, "loss/distill": 0.10 + 0.01 * s,
                     "loss/ratio": 1.0 - 1e-7 * s, "loss/clip_frac": 0.0, "time/rollout": 10.0, "time/update": 5.0,
                     "context/delta_success": -0.01 * s, "context/delta_failure": 0.005 * s,
                     "context/privilege": 0.002 * s, "context/gate": 0.01 * s})
    rows.append({"step": steps, "rollouts": 16 * steps, "tokens": 400 * steps, "kind": "eval", "eval/test/success": 0.2})
    return rows


def _axes_with(fig, values: list[float]):
    """The axes that draw a line through exactly these y values."""
    return [ax for ax in fig.axes for line in ax.lines if list(line.get_ydata()) == pytest.approx(values)]


def test_curves_put_each_loss_on_its_own_axes_and_the_ratio_apart():
    import matplotlib.pyplot as plt

    metrics = _metrics()
    fig = curves_figure(metrics, "run")
    train = [r for r in metrics if r["kind"] == "train"]
    (pg_ax,) = _axes_with(fig, [r["loss/pg"] for r in train])
    (ratio_ax,) = _axes_with(fig, [r["loss/ratio"] for r in train])
    (distill_ax,) = _axes_with(fig, [r["loss/distill"] for r in train])
    assert len({pg_ax, ratio_ax, distill_ax}) == 3
    low, high = pg_ax.get_ylim()
    assert high - low < 0.01  # a loss of +-0.002 fills its axes instead of lying flat under a ratio of 1
    assert _axes_with(fig, [100 * r["eval/test/success"] for r in metrics if r["kind"] == "eval"])
    for ax in fig.axes:
        assert ax.get_xlabel() and ax.get_ylabel() and ax.get_title(), ax.get_title()
    plt.close(fig)


@pytest.fixture(scope="module")
def tokenizer():
    from lopd.models import load_tokenizer, tiny_folder

    return load_tokenizer(tiny_folder())


def _panel(tokenizer, slots: int = 64, memory: int = 240):
    ids = tokenizer("Successful calls for similar requests: book_flight(origin='PAR', date='2025-03-01') " * 20,
                    add_special_tokens=False)["input_ids"]
    weights = torch.softmax(torch.randn(slots, memory, generator=torch.Generator().manual_seed(0)), -1)
    nearest = SimpleNamespace(indices=torch.tensor(ids[:slots][::-1]))
    return SimpleNamespace(id="test-0"), ids[:slots], nearest, weights, ids[:memory]


def test_inspect_figure_is_labelled_legible_and_unclipped(tokenizer):
    import matplotlib.pyplot as plt

    fig = inspect_figure([_panel(tokenizer), _panel(tokenizer, slots=12, memory=30)], _metrics(), tokenizer, slots=48)
    fig.canvas.draw()
    renderer, box = fig.canvas.get_renderer(), fig.bbox
    heatmaps = [ax for ax in fig.axes if ax.images]
    assert len(heatmaps) == 2
    assert sum(ax.get_ylabel() == "attention weight" for ax in fig.axes) == 2  # one colorbar per heatmap
    assert [len(ax.get_yticks()) for ax in heatmaps] == [min(48, MAX_SLOT_ROWS), 12]
    for ax in heatmaps:
        assert ax.get_xlabel() and ax.get_ylabel()
        assert len(ax.get_xticklabels()) <= X_LABELS
        labels = ax.get_yticklabels() + ax.get_xticklabels()
        assert min(t.get_fontsize() for t in labels) >= 8
        for t in labels:  # inside the figure: nothing clipped
            b = t.get_window_extent(renderer)
            assert b.x0 >= box.x0 - 1 and b.y0 >= box.y0 - 1 and b.x1 <= box.x1 + 1 and b.y1 <= box.y1 + 1, t.get_text()
        rows = sorted(t.get_window_extent(renderer).y0 for t in ax.get_yticklabels())
        heights = [t.get_window_extent(renderer).height for t in ax.get_yticklabels()]
        assert min(b - a for a, b in zip(rows, rows[1:])) >= max(heights)  # slot labels do not overlap
    top = [ax for ax in fig.axes if not ax.images and ax.get_ylabel() != "attention weight"]
    assert len(top) == 3 and "nats/token" in top[0].get_ylabel() and "nats/token" in top[1].get_ylabel()
    assert all(ax.get_xlabel() and ax.get_ylabel() for ax in top)
    plt.close(fig)
