"""Held-out evaluation: the student alone (no retrieval, no context) on an env's split.

    evaluate(run_dir_or_cfg, splits=[...])          the public `lopd.evaluate`: a run's latest checkpoint
                                                    (or a config's model) on its env's splits
    evaluate_split(model, tokenizer, env, split)    one split of one env, for a loaded model (the loop's)

Greedy decoding by default, so an evaluation is a deterministic function of the weights; with a
temperature > 0 it samples under its own seeded RNG and never disturbs the training RNG stream.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Sequence

import torch

from lopd.envs.base import Env
from lopd.rollout import env_call, sample_and_score


@dataclass
class EvalResult:
    """One split's held-out result. `success` and `reward` are fractions in [0, 1] (means over the `n` tasks:
    0.25 is 25%, which `lopd eval` and report.md print as percent); so are the per-category and per-mode
    successes."""

    split: str
    n: int
    success: float  # a fraction: 0.25 = 25% (`lopd eval` prints percent)
    reward: float
    per_category: dict[str, tuple[int, float]] = field(default_factory=dict)  # category -> (n, success)
    samples: list[dict] = field(default_factory=list)  # evaluated tasks with their completion and verdict
    modes: dict[str, float] = field(default_factory=dict)  # scoring mode -> success (envs with official/strict)
    per_category_modes: dict[str, dict[str, float]] = field(default_factory=dict)  # mode -> category -> success
    checkpoint: str = ""  # which weights (set by `evaluate`)
    config: object = field(default=None, repr=False)  # the Config evaluated under (set by `evaluate`)

    def summary(self) -> dict:
        """The JSON-able figures (`lopd eval --json`), without completions, checkpoint and config; `outcomes`
        is each evaluated task's id and whether it succeeded, in the split's order (what a paired comparison of
        two evaluations on the same tasks, e.g. McNemar's test, needs)."""
        return {"n": self.n, "success": self.success, "reward": self.reward, "modes": self.modes,
                "per_category": self.per_category, "per_category_modes": self.per_category_modes,
                "outcomes": {str(s["id"]): bool(s["success"]) for s in self.samples}}

    @classmethod
    def from_summary(cls, split: str, d: dict) -> "EvalResult":
        return cls(split=split, n=d["n"], success=d["success"], reward=d["reward"], modes=d.get("modes", {}),
                   per_category={c: tuple(v) for c, v in d.get("per_category", {}).items()},
                   per_category_modes=d.get("per_category_modes", {}))

    def metrics(self) -> dict[str, float]:
        out = {f"eval/{self.split}/success": self.success, f"eval/{self.split}/reward": self.reward}
        out.update({f"eval/{self.split}/success_{mode}": v for mode, v in self.modes.items()})
        return out


def evaluate_split(model, tokenizer, env: Env, split: str, *, max_tasks: int = 0, temperature: float = 0.0,
                   max_new_tokens: int = 64, batch_size: int = 128, seed: int = 0, keep_samples: int = 0,
                   max_turns: int = 4) -> EvalResult:
    """The student alone on `split` (its first `max_tasks` tasks; 0 = all). `keep_samples`: how many
    evaluated tasks keep their completion and verdict in `samples` (0 = all)."""
    tasks = list(env.tasks(split))
    if max_tasks:
        tasks = tasks[:max_tasks]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = sample_and_score(model, tokenizer, env, tasks, temperature=temperature, max_new_tokens=max_new_tokens,
                               batch_size=batch_size, max_turns=max_turns)
    success = out.success.tolist()
    groups: dict[str, list[bool]] = defaultdict(list)
    for t, ok in zip(tasks, success):
        groups[t.category].append(ok)
    n = len(tasks)
    modes: dict[str, float] = {}
    per_mode: dict[str, dict[str, float]] = {}
    if hasattr(env, "score_modes") and not hasattr(env, "step"):  # official and strict verdicts, side by side
        verdicts = [env_call(env, "score_modes", [t], lambda: env.score_modes(t, text))
                    for t, text in zip(tasks, out.completions)]
        for mode in verdicts[0] if verdicts else []:
            modes[mode] = sum(v[mode].success for v in verdicts) / max(n, 1)
            by_cat: dict[str, list[bool]] = defaultdict(list)
            for t, v in zip(tasks, verdicts):
                by_cat[t.category].append(v[mode].success)
            per_mode[mode] = {c: sum(x) / len(x) for c, x in by_cat.items()}
    kept = list(zip(tasks, out.completions, success, out.feedback))[: keep_samples or None]
    return EvalResult(
        split=split, n=n, success=sum(success) / max(n, 1), reward=sum(out.rewards.tolist()) / max(n, 1),
        per_category={c: (len(v), sum(v) / len(v)) for c, v in sorted(groups.items())},
        modes=modes, per_category_modes=per_mode,
        samples=[{"id": t.id, "completion": text, "success": ok, "feedback": fb, "reference": reference_of(env, t)}
                 for t, text, ok, fb in kept])


def reference_of(env: Env, task) -> str | None:
    """The task's reference answer, shown next to each evaluated sample; None for an env without
    `reference` (it is optional: only OPSD needs it, and refuses to start without it)."""
    if not callable(getattr(env, "reference", None)):
        return None
    return env_call(env, "reference", [task], lambda: env.reference(task))


def evaluate(source, *, env: Env | None = None, splits: Sequence[str] | None = None,
             overrides: Sequence[str] = (), on_result=None) -> list[EvalResult]:
    """Evaluate a run directory's latest checkpoint (or, given a config, its model's initial weights) on
    `splits` (default: the config's `env.eval_splits`) of `env` (default: the config's env). Returns one
    `EvalResult` per split; `EvalResult.checkpoint` says which weights were evaluated. `on_result` is
    called with each split's result as soon as it is done (the CLI saves it, so a killed run resumes)."""
    from lopd.config import with_overrides
    from lopd.envs import build_env
    from lopd.quiet import silence_third_party
    from lopd.runs import OpenRun, open_run
    from lopd.schema import Config
    from lopd.session import env_tasks, given_env

    silence_third_party()
    opened = OpenRun(None, with_overrides(source, list(overrides)), None) if isinstance(source, Config) \
        else open_run(source, overrides)
    cfg = opened.cfg
    env = given_env(cfg, env) if env is not None else build_env(cfg.env)
    splits = list(splits or cfg.env.eval_splits)
    for split in splits:
        env_tasks(env, split, "splits")
    model, tokenizer = opened.load_model()
    results = []
    for s in splits:
        r = evaluate_split(model, tokenizer, env, s, max_tasks=cfg.eval.max_tasks, temperature=cfg.eval.temperature,
                           max_new_tokens=cfg.rollout.max_new_tokens, batch_size=cfg.eval.batch_size,
                           seed=cfg.train.seed, max_turns=cfg.rollout.max_turns)
        r.checkpoint, r.config = opened.weights, cfg
        results.append(r)
        if on_result is not None:
            on_result(r)
    return results


def evaluate_model(*args, **kwargs) -> list[EvalResult]:
    """Deprecated name of `evaluate` (lopd.evaluate), kept for code written against it."""
    import warnings

    warnings.warn("lopd.evaluation.evaluate_model is now lopd.evaluation.evaluate (lopd.evaluate)", DeprecationWarning,
                  stacklevel=2)
    return evaluate(*args, **kwargs)


def category_table(results: list[EvalResult]) -> str:
    """Markdown table: one row per category, one column per split (and per scoring mode, if several).
    When the splits are themselves disjoint categories (`--split cat_a cat_b ...`), one column per mode
    and a last row weighted by row count."""
    owners = [c for r in results for c in r.per_category]
    if len(results) > 1 and len(owners) == len(set(owners)):
        return _stacked_table(results)
    cats = sorted({c for r in results for c in r.per_category})
    columns = [(r, mode) for r in results for mode in (list(r.modes) or [None])]
    head = "| category | " + " | ".join(f"{r.split}{f' {m}' if m else ''} % (n)" for r, m in columns) + " |"
    rows = [head, "|---|" + "---:|" * len(columns)]
    for c in cats:
        cells = []
        for r, mode in columns:
            n, s = r.per_category.get(c, (0, float("nan")))
            if mode:
                s = r.per_category_modes[mode].get(c, float("nan"))
            cells.append(f"{100 * s:.1f} ({n})" if n else "-")
        rows.append(f"| {c} | " + " | ".join(cells) + " |")
    rows.append("| **all** | " + " | ".join(f"**{100 * (r.modes[m] if m else r.success):.1f}** ({r.n})"
                                        for r, m in columns) + " |")
    return "\n".join(rows)


def _stacked_table(results: list[EvalResult]) -> str:
    modes = list(results[0].modes) or [None]
    head = "| category | n | " + " | ".join(f"{m or 'success'} %" for m in modes) + " |"
    rows = [head, "|---|---:|" + "---:|" * len(modes)]
    total = sum(r.n for r in results)
    for r in results:
        for c, (n, success) in r.per_category.items():
            cells = [100 * (r.per_category_modes[m][c] if m else success) for m in modes]
            rows.append(f"| {c} | {n} | " + " | ".join(f"{v:.1f}" for v in cells) + " |")
    summary = [100 * sum((r.modes[m] if m else r.success) * r.n for r in results) / max(total, 1) for m in modes]
    rows.append(f"| **all (weighted by rows)** | {total} | " + " | ".join(f"**{v:.1f}**" for v in summary) + " |")
    return "\n".join(rows)
