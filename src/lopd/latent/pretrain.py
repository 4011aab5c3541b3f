"""`lopd pretrain-compressor`: LOPD's compressor trained by context distillation before any RL.

The compressor (`lopd.latent.composer.Compressor`) writes K slots the frozen teacher reads where a text
context would stand. The student can follow that latent teacher only once the slots carry most of the text's
effect, and inside a run the compressor gets one optimizer step per batch (8-16 in a run) where it needs
~200 (benchmarks/RESULTS.md, 17a-17b). So, as ICAE's and xRAG's compressors are, it is trained first, on
data that costs no environment reward and no training rollout:

    corpus    (prompt messages, context) pairs. `toolworld`: requests to the `sft` pool's tools (fresh names
              and conventions per example, never a train/val/test/transfer tool) with k earlier calls of the
              same tool (sometimes of the distractor beside it) as the experiences-as-text context LOPD
              retrieves (`lopd.envs.toolworld.compressor_examples`); or a JSONL file of
              {"messages": [{"role": ..., "content": ...}, ...], "context": "..."} rows, for any env
    y         `group` completions per prompt, sampled from the frozen policy without the context at the
              rollout temperature (what the student writes at its first step; nothing is scored)
    loss      KL(pi_T(. | c, x, y<t) || pi_T(. | slots(c), x, y<t)) per token of y, averaged over the step's
              tokens; AdamW on the compressor only (the teacher's weights stay frozen), the learning rate
              decaying by a cosine to a tenth over the steps (`--schedule constant` keeps it)
    held out  the KL ratio KL(text || slots) / KL(text || no context) on a fixed held-out slice of the corpus:
              the share of the text's effect the slots do not carry (LOPD's switch to its latent teacher,
              `algorithm.lopd.latent_from_kl_ratio`, reads the same ratio in the run)

    lopd pretrain-compressor --out runs/compressor --steps 300 [key=value ...]
    lopd train --config lopd_compressor algorithm.lopd.compressor_init=runs/compressor/compressor.pt

The run folder holds `state.pt` (resumable: a stopped pretraining continues where it stopped, bit for
bit: each step's prompts and samples come from its own seed), `pretrain.jsonl` (one row per step) and,
at the end, `compressor.pt`, which `algorithm.lopd.compressor_init` loads.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import Tensor

from lopd import losses
from lopd.envs.base import DataError, Task, read_jsonl
from lopd.errors import ConfigError
from lopd.latent.composer import Compressor, memory_embeddings
from lopd.schema import Config, DistillEstimator
from lopd.teacher import FrozenTeacher, LatentSlots
from lopd.tokens import set_prompt_sharing

FORMAT = 1  # of compressor.pt
Example = tuple[tuple[dict, ...], str]  # (the prompt's chat messages, the context)


@dataclass
class PretrainSettings:
    steps: int = 300  # optimizer steps
    prompts_per_step: int = 8  # corpus prompts per step; rows per step: prompts_per_step x group
    group: int = 4  # completions sampled per prompt
    lr: float = 1e-3  # AdamW learning rate of the compressor
    schedule: str = "cosine"  # `cosine`: lr decays to lr_floor x lr at `steps` (a function of step and steps); `constant`
    lr_floor: float = 0.1  # the cosine schedule's last learning rate, as a fraction of `lr`
    held_out: int = 32  # corpus prompts held out for the KL ratio (x group rows), never trained on
    eval_every: int = 50  # steps between held-out measurements
    save_every: int = 25  # steps between resumable states
    corpus: str = "toolworld"  # `toolworld` (its sft pool with same-tool calls as context) or a JSONL path
    corpus_size: int = 4096  # toolworld corpus: examples generated (the held-out slice included)
    demonstrations: int = 2  # toolworld corpus: earlier calls per context (LOPD's retrieve_k)


# ------------------------------------------------------------------------------------------------ corpus

def read_corpus(settings: PretrainSettings, cfg: Config) -> list[Example]:
    """The corpus's (messages, context) pairs; a bad JSONL row raises a DataError naming file, line and key."""
    if settings.corpus == "toolworld":
        from lopd.envs.toolworld import compressor_examples

        tw = cfg.env.toolworld
        return list(compressor_examples(settings.corpus_size, seed=tw.seed, k=settings.demonstrations,
                                        hidden_per_tool=tw.hidden_per_tool, distractors=tw.distractors))
    path = Path(settings.corpus)
    if path.suffix != ".jsonl":
        raise ConfigError(f"--corpus {settings.corpus}: expected `toolworld` or a .jsonl file")
    out = []
    for line, row in read_jsonl(path, ("messages", "context"), with_lines=True):
        where = f"{path}:{line}"
        messages, context = row["messages"], row["context"]
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise DataError(f"{where}: 'messages' must be a non-empty list of {{'role': str, 'content': str}}")
        if not isinstance(context, str) or not context.strip():
            raise DataError(f"{where}: 'context' must be a non-empty string")
        out.append((tuple(messages), context))
    if len(out) <= settings.held_out:
        raise DataError(f"{path}: {len(out)} rows, but {settings.held_out} are held out: give more rows or a smaller --held-out")
    return out


# ------------------------------------------------------------------------------------------------ the compressor

def new_compressor(cfg: Config, latent_tokens: int, device: torch.device | str = "cpu") -> Compressor:
    """A trainable copy of the initial backbone's decoder (loaded afresh: a LoRA policy's base without its
    adapter), K memory embeddings drawn from its input-embedding table, and the output map."""
    from lopd.models import load_policy

    model, _ = load_policy(replace(cfg.model, lora=replace(cfg.model.lora, enabled=False)), device)
    table = model.get_input_embeddings().weight.detach().float().cpu()
    return Compressor(model.get_decoder(), float(table.norm(dim=-1).mean()),
                      memory_embeddings(table, latent_tokens, cfg.train.seed), latent_tokens).to(device)


def compress_texts(compressor: Compressor, tokenizer, texts: Sequence[str | None], max_tokens: int | None = None,
                   chunk: int = 64) -> Tensor:
    """The slots of each row's context, composed once per distinct text (a sampling group shares its
    retrieval), `chunk` texts per forward: [B, K, H]; zeros for a row without a context. `max_tokens`: the
    tokens of a text the compressor reads (its first ones)."""
    from lopd.rollout import left_pad

    device = compressor.memory.device
    K, H = compressor.latent_tokens, compressor.memory.shape[-1]
    unique = list(dict.fromkeys(t for t in texts if t is not None))
    out = torch.zeros(len(texts), K, H, device=device)
    if not unique:
        return out
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"][:max_tokens] for t in unique]
    slots = []
    for start in range(0, len(ids), chunk):
        part, mask = left_pad(ids[start:start + chunk], tokenizer.pad_token_id)
        slots.append(compressor(part.to(device), mask.to(device)))  # [c, K, H]
    slots = torch.cat(slots)  # [U, K, H]
    where = {t: i for i, t in enumerate(unique)}
    index = torch.tensor([where.get(t, 0) for t in texts], device=device)
    present = torch.tensor([t is not None for t in texts], device=device)[:, None, None]
    return torch.where(present, slots[index], out)


def save_compressor(compressor: Compressor, path: Path, cfg: Config, meta: dict) -> None:
    """compressor.pt: the weights and what `load_compressor` checks them against, written atomically."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"format": FORMAT, "state_dict": compressor.state_dict(), "latent_tokens": compressor.latent_tokens,
                "hidden": compressor.memory.shape[-1], "model": cfg.model.name, **meta}, tmp)
    os.replace(tmp, path)


BUNDLED = {  # name -> the file in lopd/assets: pretrained compressors shipped with the package
    "tiny-k16": ("tiny", "compressor_k16.pt"),  # RESULTS 17e: 600 steps, held-out KL ratio 0.881 -> 0.464
}


def compressor_file(value: str | Path) -> Path:
    """A compressor file's path: a bundled compressor's name (`tiny-k16`) or a path."""
    if str(value) in BUNDLED:
        import importlib.resources

        folder, name = BUNDLED[str(value)]
        return Path(str(importlib.resources.files("lopd") / "assets" / folder / name))
    return Path(value)


def load_compressor(compressor: Compressor, path: str | Path, model_name: str) -> dict:
    """Load a pretrained compressor's weights into `compressor` (built by `new_compressor` for this run's
    model and K); `path` may name a bundled one (`BUNDLED`); a file of another model, K or format raises a
    one-line ConfigError. Returns its record."""
    key = "algorithm.lopd.compressor_init"
    path = compressor_file(path)
    if not path.is_file():
        raise ConfigError(f"{key}: {path}: no such file (write one with `lopd pretrain-compressor --out DIR`, or "
                          f"name a bundled one: {', '.join(BUNDLED)})")
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is one line
        raise ConfigError(f"{key}: {path}: not a compressor file ({type(e).__name__}: {str(e)[:80]})") from None
    if not isinstance(saved, dict) or saved.get("format") != FORMAT:
        raise ConfigError(f"{key}: {path}: not a compressor file of format {FORMAT}")
    if saved["model"] != model_name:
        raise ConfigError(f"{key}: {path} was trained for model {saved['model']!r}, this run's is {model_name!r}")
    if saved["latent_tokens"] != compressor.latent_tokens:
        raise ConfigError(f"{key}: {path} writes {saved['latent_tokens']} slots, but algorithm.lopd.latent_tokens "
                          f"is {compressor.latent_tokens}")
    missing, unexpected = compressor.load_state_dict(saved["state_dict"], strict=False)
    if missing or unexpected:
        raise ConfigError(f"{key}: {path} does not fit this model's compressor (missing {missing[:2]}, "
                          f"unexpected {unexpected[:2]})")
    return {k: v for k, v in saved.items() if k != "state_dict"}


def pretrained_compressor(cfg: Config, path: str | Path, device: torch.device | str = "cpu") -> Compressor:
    """The compressor `path` holds, for this config's model, at the K it was trained with."""
    try:
        K = torch.load(compressor_file(path), map_location="cpu", weights_only=True)["latent_tokens"]
    except Exception:  # noqa: BLE001 - load_compressor names what is wrong
        K = cfg.algorithm.lopd.latent_tokens
    compressor = new_compressor(cfg, K, device)
    load_compressor(compressor, path, cfg.model.name)
    return compressor


# ------------------------------------------------------------------------------------------------ pretraining

def no_context_rows(teacher: FrozenTeacher, tokenizer, examples: Sequence[Example], group: int, temperature: float,
                    max_new_tokens: int, seed: int):
    """`group` completions per example's prompt, sampled without its context under `seed` (the global RNG
    is left as it was), as a RolloutBatch with nothing scored."""
    from lopd.prompts import encode_prompt
    from lopd.rollout import RolloutBatch, sample

    tasks = [Task(id=f"corpus/{i}", messages=m, answer=None) for i, (m, _) in enumerate(examples)]
    prompts = [encode_prompt(tokenizer, t.messages) for t in tasks]
    with torch.random.fork_rng(devices=[]), torch.no_grad(), teacher.active() as model:
        torch.manual_seed(seed)
        s = sample(model, tokenizer, [p for p in prompts for _ in range(group)], temperature=temperature,
                   max_new_tokens=max_new_tokens)
    B = len(s.completions)
    return RolloutBatch(**vars(s), tasks=[t for t in tasks for _ in range(group)],
                        group=torch.arange(len(tasks)).repeat_interleave(group), rewards=torch.zeros(B),
                        success=torch.zeros(B, dtype=torch.bool), feedback=[""] * B).trimmed()


def distillation_kl(teacher: FrozenTeacher, batch, contexts: list[str], slots: Tensor, text=None) -> Tensor:
    """[B, T] KL(pi_T(.|c) || pi_T(.|slots)) per completion token (gradient into the slots); `text`: the
    text teacher's TokenStats if already scored."""
    if text is None:
        with torch.no_grad():
            text = teacher.score(batch, contexts)
    latent, _ = teacher.score_latent(batch, contexts, LatentSlots(slots, over_context=False))
    return losses.token_divergence(latent, text, DistillEstimator.jsd, alpha=0.0)


def kl_ratio(teacher: FrozenTeacher, compressor: Compressor, tokenizer, batch, contexts: list[str], rows: int = 64) -> float:
    """KL(text || slots) / KL(text || no context) over the batch's completion tokens."""
    num = den = 0.0
    with torch.no_grad():
        for start in range(0, len(batch), rows):
            idx = torch.arange(start, min(start + rows, len(batch)))
            mb, ctx = batch.select(idx), contexts[start:start + len(idx)]
            text = teacher.score(mb, ctx)
            mask = mb.completion_mask
            num += float((distillation_kl(teacher, mb, ctx, compress_texts(compressor, tokenizer, ctx), text) * mask).sum())
            none = losses.token_divergence(teacher.score(mb), text, DistillEstimator.jsd, alpha=0.0)
            den += float((none * mask).sum())
    return num / den if den else math.nan


def pretrain_compressor(cfg: Config, settings: PretrainSettings, out: str | Path,
                        progress: Callable[[dict], None] | None = None, stop_after: int | None = None) -> dict | None:
    """Train a compressor of `cfg.algorithm.lopd.latent_tokens` slots on the corpus; resumable from
    `out/state.pt`. Writes `out/compressor.pt` and returns its record (the held-out KL ratio before and after);
    `stop_after`: leave after that step with its state saved, as an interrupted pretraining (returns None)."""
    from lopd.models import load_policy

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    set_prompt_sharing(cfg.train.share_prompts)
    seed, K = cfg.train.seed, cfg.algorithm.lopd.latent_tokens
    examples = read_corpus(settings, cfg)
    held, pool = examples[:settings.held_out], examples[settings.held_out:]
    policy, tokenizer = load_policy(cfg.model)
    teacher = FrozenTeacher(policy, tokenizer, cfg.rollout.temperature)
    torch.manual_seed(seed)
    compressor = new_compressor(cfg, K)
    optimizer = torch.optim.AdamW(compressor.parameters(), lr=settings.lr)
    sample_kw = dict(group=settings.group, temperature=cfg.rollout.temperature, max_new_tokens=cfg.rollout.max_new_tokens)
    held_batch = no_context_rows(teacher, tokenizer, held, seed=seed + 10**6, **sample_kw)
    held_contexts = [held[int(g)][1] for g in held_batch.group]

    # what a resumed pretraining must share with the stopped one (more --steps continues it)
    header = {"settings": {k: v for k, v in asdict(settings).items() if k != "steps"}, "model": cfg.model.name,
              "latent_tokens": K, "seed": seed}
    state_path, log_path = out / "state.pt", out / "pretrain.jsonl"
    step, rows = 0, []
    if state_path.is_file():
        state = torch.load(state_path, map_location="cpu", weights_only=False)
        if state["header"] != json.loads(json.dumps(header)):
            raise ConfigError(f"{out}: holds a pretraining of other settings ({state_path}); give another --out")
        compressor.load_state_dict(state["compressor"])
        optimizer.load_state_dict(state["optimizer"])
        step, rows = state["step"], state["rows"]
    first = rows[0]["held_out_kl_ratio_at_start"] if rows else kl_ratio(teacher, compressor, tokenizer, held_batch, held_contexts)

    def save_state() -> None:
        tmp = state_path.with_name("state.pt.tmp")
        torch.save({"header": json.loads(json.dumps(header)), "step": step, "rows": rows,
                    "compressor": compressor.state_dict(), "optimizer": optimizer.state_dict()}, tmp)
        os.replace(tmp, state_path)
        log_path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    if settings.schedule not in ("cosine", "constant"):
        raise ConfigError(f"--schedule {settings.schedule!r}: expected cosine or constant")

    def learning_rate(at: int) -> float:
        if settings.schedule == "constant":
            return settings.lr
        done = min(at / max(settings.steps, 1), 1.0)
        return settings.lr * (settings.lr_floor + (1 - settings.lr_floor) * 0.5 * (1 + math.cos(math.pi * done)))

    while step < settings.steps:
        start = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step)
        chosen = random.Random(f"{seed}/{step}").sample(range(len(pool)), settings.prompts_per_step)
        part = [pool[i] for i in chosen]
        batch = no_context_rows(teacher, tokenizer, part, seed=seed * 10**6 + step, **sample_kw)
        contexts = [part[int(g)][1] for g in batch.group]
        kl = distillation_kl(teacher, batch, contexts, compress_texts(compressor, tokenizer, contexts))  # [B, T]
        mask = batch.completion_mask
        loss = (kl * mask).sum() / mask.sum().clamp(min=1)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(compressor.parameters(), 1.0)
        optimizer.step()
        step += 1
        row = {"step": step, "loss/cd": loss.item(), "lr": learning_rate(step - 1), "seconds": time.perf_counter() - start}
        if step % settings.eval_every == 0 or step == settings.steps:
            row["held_out_kl_ratio"] = kl_ratio(teacher, compressor, tokenizer, held_batch, held_contexts)
        if not rows:
            row["held_out_kl_ratio_at_start"] = first
        rows.append(row)
        if progress:
            progress(row)
        if step % settings.save_every == 0 or step == settings.steps or step == stop_after:
            save_state()
        if step == stop_after:
            return None
    last = next(r["held_out_kl_ratio"] for r in reversed(rows) if "held_out_kl_ratio" in r) if rows else first
    meta = {"steps": step, "settings": asdict(settings), "held_out_kl_ratio": last, "held_out_kl_ratio_at_start": first,
            "seed": seed}
    save_compressor(compressor, out / "compressor.pt", cfg, meta)
    return meta
