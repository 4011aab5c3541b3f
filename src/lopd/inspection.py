"""`lopd inspect RUN_DIR`: what an LOPD run's latent slots carry, as a picture and a table.

For a few held-out tasks, with the run's latest composer and its experience bank (read-only):
    - the retrieved experiences (request -> answer) and their similarity,
    - the composer's attention of each latent slot over the experiences' tokens (last resampler layer),
    - each slot's nearest vocabulary token (cosine over the teacher's input embeddings) next to the
      context token it lies over: where they differ, the composer has rewritten that token,
    - whether the slots carry different things (`slot_summary`): how alike the composer's additions are
      across slots, and how many slots put their largest attention weight on the same memory token,
and, over training, Delta on successes and failures, the privilege A * Delta and the gate.
Writes RUN_DIR/inspect.png and RUN_DIR/inspect.md; changes nothing else in the run directory.
"""

from __future__ import annotations

from pathlib import Path

import torch

from lopd.errors import ConfigError


def inspect_run(run_dir: str | Path, *, tasks: int = 3, split: str | None = None, slots: int = 48) -> tuple[Path, Path]:
    from lopd.algorithms import build_algorithm
    from lopd.algorithms.lopd import LOPD, RetrievalContext, experiences_as_text
    from lopd.envs import build_env
    from lopd.latent.experience_bank import ExperienceBank
    from lopd.prompts import context_span, task_text
    from lopd.session import open_run

    opened = open_run(run_dir)
    run, cfg, checkpoint = opened.run, opened.cfg, opened.checkpoint
    if checkpoint is None:
        raise ConfigError(f"{run_dir}: no checkpoint yet")
    env = build_env(cfg.env)
    model, tokenizer = opened.load_model("cpu")
    algorithm = build_algorithm(cfg)
    if not isinstance(algorithm, LOPD):
        raise ConfigError(f"{run_dir}: algorithm '{cfg.algorithm.name}' has no latent slots to inspect (lopd only)")
    algorithm.setup(policy=model, tokenizer=tokenizer, env=env, run=None)
    state = torch.load(checkpoint / "state.pt", weights_only=False)["algorithm"]
    algorithm.composer.load_state_dict(state["composer"])
    algorithm.memory.bank = ExperienceBank(algorithm.memory.embedder.dim, run.bank_dir, readonly=True)
    split = split or (cfg.env.eval_splits[0] if cfg.env.eval_splits else cfg.env.train_split)
    chosen = list(env.tasks(split))[:tasks]
    bank = algorithm.memory.bank
    c = cfg.algorithm.lopd
    found = algorithm.memory.search([task_text(t) for t in chosen])  # the same retrieval as in training
    with algorithm.initial_policy.active() as frozen:
        table = frozen.get_input_embeddings().weight.detach().float()  # [V, H]
    unit = torch.nn.functional.normalize(table, dim=-1)
    panels, lines = [], [f"# What the latent slots of `{run.path.name}` carry ({checkpoint.name}, split `{split}`)", ""]
    for task, ids, sims in zip(chosen, found.index, found.similarity):
        lines += [f"## {task.id}: {task_text(task)}", ""]
        if not ids:
            lines += ["Nothing retrieved: no context, no slots.", ""]
            continue
        lines += [f"- {s:.2f} {'ok' if bank.entries[i].success else 'fail'}: {bank.entries[i].task_text} -> "
                  f"{bank.entries[i].trajectory}" for i, s in zip(ids, sims)] + [""]
        ctx = RetrievalContext(step=0, privileged=[experiences_as_text(bank, ids)], retrieved=[ids],
                               has_context=torch.ones(1, dtype=torch.bool))
        attention: list[torch.Tensor] = []
        prompt, start, end = context_span(tokenizer, task.messages, ctx.privileged[0])
        under = prompt[start:end][: c.latent_tokens]
        with torch.no_grad():
            below = algorithm.tokens_under_slots([task], ctx.privileged) if algorithm.composer.token_in is not None else None
            added = algorithm.compose(ctx, attention=attention, under=below)[0]  # [K, H]
        # the slots as the teacher reads them: over the context's tokens, or K slots of their own
        z = table[torch.tensor(under)] + added[: len(under)] if algorithm.composer.copy_tokens else added[: len(under)]
        nearest = (torch.nn.functional.normalize(z, dim=-1) @ unit.T).max(-1)  # cosine to every token
        memory_tokens = []
        for i in ids:
            e = bank.entries[i]
            memory_tokens += tokenizer(f"{e.task_text} -> {e.trajectory}", add_special_tokens=False)["input_ids"][
                : c.max_experience_tokens]
        weights = attention[-1][0, :, 1:1 + len(memory_tokens)] if attention else None  # [K, M] (null slot dropped)
        rewritten = [(k, tokenizer.decode([under[k]]), tokenizer.decode([int(j)]), float(s))
                     for k, (j, s) in enumerate(zip(nearest.indices.tolist(), nearest.values.tolist()))
                     if k < len(under) and int(j) != under[k]]
        lines += [f"{len(under)} slots over the context, gate tanh(g) = {float(torch.tanh(algorithm.composer.gate.detach())):.3f}; "
                  f"{len(rewritten)} slots' nearest token differs from the token under them"
                  + (":" if rewritten else "."), ""]
        lines += [f"- slot {k}: {a!r} -> {b!r} (cos {s:.2f})" for k, a, b, s in rewritten[:20]] + ([""] if rewritten else [])
        alike = slot_summary(added[: len(under)], weights[: len(under)] if weights is not None else None)
        lines += [f"Slots alike: the composer's additions have mean pairwise cosine {alike['cosine']:.2f} "
                  f"(1 = one vector for every slot)"
                  + (f"; {alike['shared_focus']:.0%} of the slots put their largest attention weight on the same "
                     f"memory token" if "shared_focus" in alike else "") + ".", ""]
        panels.append((task, under, nearest, weights, memory_tokens))
    metrics = run.read_metrics()
    out_png, out_md = run.inspect_png, run.inspect_md
    _draw(out_png, panels, metrics, tokenizer, slots)
    lines += ["![inspect](inspect.png)", ""]
    out_md.write_text("\n".join(lines))
    return out_png, out_md


def slot_summary(added: torch.Tensor, weights: torch.Tensor | None = None) -> dict[str, float]:
    """Do the slots carry different things? `added`: [K, H], what the composer adds to each slot; `weights`:
    [K, M], each slot's attention over the memory tokens (or None).
    cosine: mean cosine between the additions of two different slots (1: the same direction everywhere);
    shared_focus: the share of slots whose largest attention weight falls on the most common such token."""
    from lopd.latent.composer import slot_cosine

    out = {"cosine": float(slot_cosine(added[None], torch.ones(1, len(added), dtype=torch.bool))[0])}
    if weights is not None and weights.numel():
        top = weights.argmax(-1)  # [K]
        out["shared_focus"] = float(torch.bincount(top).max()) / len(top)
    return out


def _draw(path: Path, panels, metrics, tokenizer, slots: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = 1 + len(panels)
    fig = plt.figure(figsize=(18, 3.6 + 4.2 * len(panels)), constrained_layout=True)
    grid = fig.add_gridspec(rows, 3, height_ratios=[3.2] + [4.2] * len(panels))
    series = {k: [(r["rollouts"], r[k]) for r in metrics if k in r] for k in
              ("context/delta_success", "context/delta_failure", "context/privilege", "context/gate")}
    ax = fig.add_subplot(grid[0, 0])
    for k, label in (("context/delta_success", "successes"), ("context/delta_failure", "failures")):
        if series[k]:
            ax.plot(*zip(*series[k]), label=label)
    ax.axhline(0, color="grey", lw=0.8)
    ax.set(title="Δ: latent teacher vs context-free model (nats/token)", xlabel="rollouts")
    ax.legend()
    for j, (k, title) in enumerate((("context/privilege", "privilege: mean A·Δ"), ("context/gate", "gate tanh(g)")), 1):
        ax = fig.add_subplot(grid[0, j])
        if series[k]:
            ax.plot(*zip(*series[k]))
        ax.set(title=title, xlabel="rollouts")
        ax.grid(alpha=0.3)
    for i, (task, under, nearest, weights, memory_tokens) in enumerate(panels, 1):
        ax = fig.add_subplot(grid[i, :])
        shown = min(slots, len(under))
        if weights is not None and shown:
            w = weights[:shown].float().numpy()
            ax.imshow(w, aspect="auto", cmap="viridis", interpolation="nearest")
            step = max(1, len(memory_tokens) // 90)
            ax.set_xticks(range(0, len(memory_tokens), step))
            ax.set_xticklabels([tokenizer.decode([t]).replace("\n", "⏎") for t in memory_tokens[::step]], rotation=90,
                               fontsize=6)
            labels = []
            for k in range(shown):
                a, b = tokenizer.decode([under[k]]), tokenizer.decode([int(nearest.indices[k])])
                labels.append(f"{k}: {a!r}" + ("" if a == b else f" → {b!r}"))
            ax.set_yticks(range(shown))
            ax.set_yticklabels(labels, fontsize=6)
        ax.set_title(f"{task.id}: attention of the first {shown} slots (rows: the context token under each slot "
                     f"→ its nearest token if rewritten) over the retrieved experiences' tokens", fontsize=9)
    fig.savefig(path, dpi=110)
    plt.close(fig)
