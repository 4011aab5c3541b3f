"""`lopd inspect RUN_DIR`: what an LOPD run's latent slots carry, as a picture and a table.

For a few held-out tasks, with the run's latest composer and its experience bank (read-only):
    - the retrieved experiences (request -> answer) and their similarity,
    - the composer's attention of each latent slot over the experiences' tokens (last resampler layer; for a
      compressor, the last decoder layer's attention of each memory column over the context's tokens),
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
    from lopd.runs import open_run

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
    found = algorithm.memory.search(chosen)  # the same retrieval as in training
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
        if algorithm.compresses:  # K slots of their own, written by the compressor from the context's text
            panel, text = compressor_panel(algorithm, tokenizer, task, ctx.privileged[0], unit)
            panels.append(panel)
            lines += text
            continue
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


def compressor_panel(algorithm, tokenizer, task, context: str, unit: torch.Tensor):
    """One task's panel and lines for a compressor (`Compressor`): its K slots for the context, each slot's
    nearest vocabulary token, and the last decoder layer's attention of each memory column over the context's
    tokens (heads averaged), computed with eager attention (the only kind that returns weights)."""
    compressor = algorithm.composer
    K = compressor.latent_tokens
    ids = tokenizer(context, add_special_tokens=False)["input_ids"][: algorithm.compressor_token_limit]
    compressor.decoder.set_attn_implementation("eager")  # this algorithm object serves the inspection only
    attention: list[torch.Tensor] = []
    with torch.no_grad():
        slots = compressor(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long), attention=attention)[0]
    weights = attention[-1][0, :, : len(ids)]  # [K, L]: the memory columns' attention over the context
    nearest = (torch.nn.functional.normalize(slots.float(), dim=-1) @ unit.T).max(-1)  # [K] cosine to every token
    alike = slot_summary(slots, weights)
    tokens = ", ".join(f"{k}: {tokenizer.decode([int(j)])!r} ({float(v):.2f})"
                       for k, (j, v) in enumerate(zip(nearest.indices, nearest.values)))
    lines = [f"{K} slots of their own for {len(ids)} context tokens ({len(ids) / K:.1f}x fewer); each slot's "
             f"nearest token (cosine): {tokens}", "",
             f"Slots alike: mean pairwise cosine {alike['cosine']:.2f} (1 = one vector for every slot); "
             f"{alike['shared_focus']:.0%} of the slots put their largest attention weight on the same context "
             f"token.", ""]
    return (task, [None] * K, nearest, weights, ids), lines


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


MAX_SLOT_ROWS = 40  # slot rows drawn per task: more would need a font too small to read
FONT = 8  # points, for every tick label (at dpi 110: 12 pixels)
ROW_INCHES = 0.17  # height of one slot row, so its 8-point label does not touch the next
X_LABELS = 100  # at most this many memory-token labels under a heatmap (about 0.15 inch apart)


def _draw(path: Path, panels, metrics, tokenizer, slots: int) -> None:
    """inspect.png (`inspect_figure`), cropped to what is drawn: no label is clipped, whatever its length."""
    import matplotlib.pyplot as plt

    fig = inspect_figure(panels, metrics, tokenizer, slots)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def inspect_figure(panels, metrics, tokenizer, slots: int):
    """Over training, Δ, the privilege and the gate; then per task a heatmap of the attention of each latent
    slot (rows, at most MAX_SLOT_ROWS) over the retrieved experiences' tokens (columns), with a colorbar.
    `panels`: (task, token ids under the slots, nearest tokens (.indices), attention [K, M] or None, memory
    token ids) per task, as `inspect_run` gathers them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [min(slots, MAX_SLOT_ROWS, len(under)) for _, under, _, _, _ in panels]
    heights = [3.4] + [ROW_INCHES * n + 2.4 for n in shown]  # rows, plus the title and the rotated x labels
    fig = plt.figure(figsize=(18, sum(heights)), layout="constrained")
    grid = fig.add_gridspec(len(heights), 3, height_ratios=heights)
    _draw_training([fig.add_subplot(grid[0, j]) for j in range(3)], metrics)
    for i, (panel, n) in enumerate(zip(panels, shown), 1):
        _draw_attention(fig, fig.add_subplot(grid[i, :]), panel, n, tokenizer)
    return fig


def _draw_training(axes, metrics) -> None:
    """Three panels over the rollouts: Δ on successes and failures, the privilege mean A·Δ, the gate."""
    series = {k: [(r["rollouts"], r[k]) for r in metrics if k in r] for k in
              ("context/delta_success", "context/delta_failure", "context/privilege", "context/gate")}
    panels = [([("context/delta_success", "successes"), ("context/delta_failure", "failures")],
               "Δ: latent teacher vs context-free model", "Δ (nats/token)"),
              ([("context/privilege", None)], "Privilege: mean A·Δ over the batch", "A·Δ (nats/token)"),
              ([("context/gate", None)], "Gate of the composer's additions", "tanh(g)")]
    for ax, (curves, title, ylabel) in zip(axes, panels):
        for key, label in curves:
            if series[key]:
                ax.plot(*zip(*series[key]), marker="o" if len(series[key]) <= 30 else None, ms=4, label=label)
        if len(curves) > 1 and ax.lines:
            ax.legend()
        ax.axhline(0, color="grey", lw=0.8)
        ax.set(title=title, xlabel="rollouts (sampled trajectories)", ylabel=ylabel)
        ax.grid(alpha=0.3)


def _slot_label(tokenizer, under: int | None, nearest: int, k: int) -> str:
    """'k: token under the slot', and '→ its nearest token' where the composer rewrote it ('k: ≈ nearest
    token' for a slot of its own, under no token)."""
    if under is None:
        return f"{k}: ≈{tokenizer.decode([nearest])!r}"
    a, b = tokenizer.decode([under]), tokenizer.decode([nearest])
    return f"{k}: {a!r}" + ("" if a == b else f" → {b!r}")


def _draw_attention(fig, ax, panel, shown: int, tokenizer) -> None:
    task, under, nearest, weights, memory_tokens = panel
    own = under and under[0] is None  # a compressor's slots: its memory columns' attention over the context
    ax.set_title(f"{task.id}: attention of the first {shown} of {len(under)} latent slots over the retrieved "
                 f"experiences' tokens (last {'compressor decoder' if own else 'resampler'} layer)", fontsize=10)
    if weights is None or not shown:
        ax.text(0.5, 0.5, "no attention recorded", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
    image = ax.imshow(weights[:shown].float().numpy(), aspect="auto", cmap="viridis", interpolation="nearest")
    fig.colorbar(image, ax=ax, pad=0.01, fraction=0.03, label="attention weight")
    step = -(-len(memory_tokens) // X_LABELS)
    ax.set_xticks(range(0, len(memory_tokens), step))
    ax.set_xticklabels([tokenizer.decode([t]).replace("\n", "⏎") for t in memory_tokens[::step]], rotation=90,
                       fontsize=FONT)
    ax.set_yticks(range(shown))
    ax.set_yticklabels([_slot_label(tokenizer, under[k], int(nearest.indices[k]), k) for k in range(shown)],
                       fontsize=FONT)
    ax.set_xlabel("tokens of the retrieved experiences (request -> answer, in retrieval order"
                  + (f"; one in {step} labelled)" if step > 1 else ")"))
    ax.set_ylabel("slot: ≈ its nearest token" if own else "slot: token under it (→ nearest token if rewritten)")
