"""Batched sampling with a KV cache: prompts in, completions with their per-token log-probs out.

`sample` left-pads prompts, decodes with Hugging Face `generate` (KV cache, temperature, top-p, EOS),
and returns right-padded completions whose mask covers every generated token up to and including
the first EOS. The sampler's log-probs are log softmax(logits / temperature) at the sampled tokens,
the untruncated distribution, which is exactly what `tokens.score_completions(...).logprobs()` recomputes
at the same temperature, so the importance ratio of an un-updated policy is 1.

`sample_and_score` samples G trajectories per task, scores them with the env, and returns a
`RolloutBatch`, for training (`collect`) and evaluation alike; for envs with a `step` method,
`sample_episodes` runs multi-turn episodes (tool results and user turns fed back as observations,
masked from every loss).

This is the boundary where an env's answers enter the run (`env_call`, `checked_score`): an env method that
raises, or a score that is no Score or has a non-finite reward, stops the run with one line naming the
method and the task, never a NaN that surfaces steps later as a "non-finite loss".
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from lopd.envs.base import Env, Score, Task
from lopd.errors import EnvError, LopdError
from lopd.prompts import encode_prompt, prompt_text


@dataclass
class Samples:
    prompt_ids: torch.Tensor  # [B, P] left-padded
    prompt_mask: torch.Tensor  # [B, P]
    completion_ids: torch.Tensor  # [B, C] right-padded
    completion_mask: torch.Tensor  # [B, C] generated tokens up to and including EOS
    sampler_logprobs: torch.Tensor  # [B, C] log pi(y_t | prefix) at the sampling temperature; 0 on pads
    completions: list[str]  # the decoded completions
    truncated: torch.Tensor  # [B] bool: stopped by max_new_tokens, not by EOS
    # [B, C] tokens the model attends to: the trained ones plus, in multi-turn episodes, the observations
    # (tool results, user turns) between them, which are context but never trained on. None = completion_mask.
    completion_attention: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.completion_mask.sum())

    @property
    def attention(self) -> torch.Tensor:
        return self.completion_mask if self.completion_attention is None else self.completion_attention


@dataclass
class RolloutBatch(Samples):
    tasks: list[Task] = field(default_factory=list)  # [B] the task of each trajectory
    group: torch.Tensor = None  # [B] group id: trajectories of one task share it
    rewards: torch.Tensor = None  # [B]
    success: torch.Tensor = None  # [B] bool
    feedback: list[str] = field(default_factory=list)
    # [B, T] truncated importance weights pi_trainer / pi_sampler, when another engine sampled (vLLM); None = 1
    is_weights: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.completions)

    def trimmed(self) -> "RolloutBatch":
        """Drop prompt columns that are padding in every row, and completion columns after every end."""
        first = int(self.prompt_mask.any(0).long().argmax()) if self.prompt_mask.any() else 0
        used = self.attention.any(0).nonzero()
        last = int(used[-1]) + 1 if len(used) else 0
        out = RolloutBatch(**{k: getattr(self, k) for k in self.__dataclass_fields__})
        out.prompt_ids, out.prompt_mask = self.prompt_ids[:, first:], self.prompt_mask[:, first:]
        out.completion_ids, out.completion_mask = self.completion_ids[:, :last], self.completion_mask[:, :last]
        out.sampler_logprobs = self.sampler_logprobs[:, :last]
        if self.completion_attention is not None:
            out.completion_attention = self.completion_attention[:, :last]
        if self.is_weights is not None:
            out.is_weights = self.is_weights[:, :last]
        return out

    @staticmethod
    def concat(batches: Sequence["RolloutBatch"], pad: int) -> "RolloutBatch":
        """One batch of several (a step's shares, gathered from the ranks in rank order)."""
        if len(batches) == 1:
            return batches[0]
        s = _concat(list(batches), pad)
        return RolloutBatch(**vars(s), tasks=[t for b in batches for t in b.tasks],
                            group=torch.cat([b.group for b in batches]), rewards=torch.cat([b.rewards for b in batches]),
                            success=torch.cat([b.success for b in batches]), feedback=[f for b in batches for f in b.feedback])

    def to(self, device: torch.device | str) -> "RolloutBatch":
        """The same batch with every tensor on `device` (batches are built on the CPU)."""
        values = {k: getattr(self, k) for k in self.__dataclass_fields__}
        return RolloutBatch(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in values.items()})

    def select(self, index: torch.Tensor) -> "RolloutBatch":
        """The trajectories at `index` (a minibatch), every field sliced alike."""
        idx = index.tolist()
        return RolloutBatch(
            prompt_ids=self.prompt_ids[index], prompt_mask=self.prompt_mask[index],
            completion_ids=self.completion_ids[index], completion_mask=self.completion_mask[index],
            sampler_logprobs=self.sampler_logprobs[index], completions=[self.completions[i] for i in idx],
            truncated=self.truncated[index],
            completion_attention=None if self.completion_attention is None else self.completion_attention[index],
            tasks=[self.tasks[i] for i in idx], group=self.group[index],
            rewards=self.rewards[index], success=self.success[index], feedback=[self.feedback[i] for i in idx],
            is_weights=None if self.is_weights is None else self.is_weights[index])


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if len(s):
            ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s):] = 1
    return ids, mask


# A padded batch attends through a [rows, L, L] mask (and, on CPU, a score tensor of that size per head):
# about 5 bytes per element measured with the tiny policy. A chunk of prompts is split further when
# rows x L^2 would pass this bound (L = its longest prompt + max_new_tokens), so a few very long
# prompts (BFCL live_multiple: up to 27k tokens for the tiny policy's tokenizer) decode in small
# batches instead of one batch that needs tens of GB. Batches under the bound are left as they are.
MAX_ATTENTION_ELEMENTS = 2**28


def decode_chunks(lengths: Sequence[int], batch_size: int, extra: int = 0,
                  max_elements: int = MAX_ATTENTION_ELEMENTS) -> list[range]:
    """Consecutive index ranges of at most `batch_size` prompts whose rows x (longest + extra)^2 stays
    within `max_elements` (a prompt that alone passes it decodes alone). Order is kept."""
    out, start, longest = [], 0, 0
    for i, n in enumerate(lengths):
        rows, wide = i - start + 1, max(longest, n)
        if rows > 1 and (rows > batch_size or rows * (wide + extra) ** 2 > max_elements):
            out.append(range(start, i))
            start, wide = i, n
        longest = wide
    if len(lengths):
        out.append(range(start, len(lengths)))
    return out


def _eos_ids(tokenizer, model) -> list[int]:
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
        eos.append(tokenizer.eos_token_id)
    return eos


@torch.no_grad()
def sample(model, tokenizer, prompts: Sequence[Sequence[int]], *, temperature: float = 1.0, top_p: float = 1.0,
           max_new_tokens: int = 64, batch_size: int = 128,
           max_attention_elements: int = MAX_ATTENTION_ELEMENTS) -> Samples:
    """Decode a completion for every prompt (token ids), `batch_size` at a time (fewer where the prompts
    are so long that a padded batch's attention would pass `max_attention_elements`: see `decode_chunks`).
    temperature 0 = greedy."""
    device = next(model.parameters()).device
    eos = _eos_ids(tokenizer, model)
    pad = tokenizer.pad_token_id
    chunks: list[Samples] = []
    was_training = model.training
    model.eval()
    from lopd.fsdp import is_sharded

    synced = is_sharded(model)  # every rank keeps decoding until all have finished (each step is collective)
    # sharded, every rank must make the same number of generate calls: chunks by count only there
    bound = max_attention_elements if not synced else float("inf")
    for part in decode_chunks([len(p) for p in prompts], batch_size, max_new_tokens, bound):
        ids, mask = left_pad(prompts[part.start:part.stop], pad)
        ids, mask = ids.to(device), mask.to(device)
        greedy = temperature <= 0
        prefilled = {} if synced else shared_prefill(model, ids, mask)  # a group's prompt, read once
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=not greedy,
            temperature=None if greedy else temperature, top_p=None if greedy or top_p >= 1 else top_p, top_k=None,
            eos_token_id=eos, pad_token_id=pad, output_logits=True, return_dict_in_generate=True, synced_gpus=synced,
            **prefilled)
        completion = out.sequences[:, ids.shape[1]:]  # [b, C]
        scale = 1.0 if greedy else temperature
        chosen = torch.stack([  # step by step, never a [b, C, V] tensor: [b, C]
            torch.log_softmax(step.float() / scale, dim=-1).gather(-1, completion[:, t, None]).squeeze(-1)
            for t, step in enumerate(out.logits)], dim=1)
        is_eos = torch.isin(completion, torch.tensor(eos, device=device))
        seen_eos_before = (is_eos.cumsum(-1) - is_eos.long()) > 0  # [b, C] an EOS occurred strictly earlier
        cmask = (~seen_eos_before).long()
        truncated = ~is_eos.any(-1)
        texts = [tokenizer.decode(row[m.bool()], skip_special_tokens=True) for row, m in zip(completion, cmask)]
        chunks.append(Samples(ids.cpu(), mask.cpu(), completion.cpu(), cmask.cpu(), (chosen * cmask).cpu(), texts,
                              truncated.cpu()))
    model.train(was_training)
    return _concat(chunks, pad)


def shared_prefill(model, ids: torch.Tensor, mask: torch.Tensor) -> dict:
    """`generate`'s cache of every prompt but its last token, each distinct prompt run once and its keys and
    values copied to the rows that share it (a sampling group); {} when every prompt is distinct or sharing
    is off (`train.share_prompts`). `generate` then reads the last prompt token and decodes as without it.
    ids, mask: [b, P] left-padded."""
    from lopd.tokens import decoder_and_head, forward_parameters, positions, prompt_sharing, shared_prompts

    if not prompt_sharing() or ids.shape[1] < 2:
        return {}
    shared = shared_prompts(ids.cpu(), mask.cpu(), None)
    if shared is None:
        return {}
    first, inverse = (t.to(ids.device) for t in shared)
    decoder, _ = decoder_and_head(model)
    head = mask[first, :-1]  # [U, P-1]
    out = decoder(input_ids=ids[first, :-1], attention_mask=head, position_ids=positions(head), use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    cache.reorder_cache(inverse)
    return {"cache" if "cache" in forward_parameters(type(decoder)) else "past_key_values": cache}


def _concat(chunks: list[Samples], pad: int) -> Samples:
    P = max(c.prompt_ids.shape[1] for c in chunks)
    used = [c.attention.any(0).nonzero() for c in chunks]  # columns some row attends to
    C = max(int(u[-1]) + 1 if len(u) else 0 for u in used)  # (episodes: observations included)

    def fit(x: torch.Tensor, width: int, value: int | float, left: bool) -> torch.Tensor:
        x = x[:, :width] if not left else x
        gap = width - x.shape[1]
        if gap <= 0:
            return x
        filler = torch.full((x.shape[0], gap), value, dtype=x.dtype)
        return torch.cat([filler, x] if left else [x, filler], dim=1)

    attention = None
    if any(c.completion_attention is not None for c in chunks):
        attention = torch.cat([fit(c.attention, C, 0, False) for c in chunks])
    return Samples(
        completion_attention=attention,
        prompt_ids=torch.cat([fit(c.prompt_ids, P, pad, True) for c in chunks]),
        prompt_mask=torch.cat([fit(c.prompt_mask, P, 0, True) for c in chunks]),
        completion_ids=torch.cat([fit(c.completion_ids, C, pad, False) for c in chunks]),
        completion_mask=torch.cat([fit(c.completion_mask, C, 0, False) for c in chunks]),
        sampler_logprobs=torch.cat([fit(c.sampler_logprobs, C, 0.0, False) for c in chunks]),
        completions=[t for c in chunks for t in c.completions],
        truncated=torch.cat([c.truncated for c in chunks]))


def sample_episodes(model, tokenizer, env: Env, tasks: Sequence[Task], *, max_turns: int, temperature: float = 1.0,
                    top_p: float = 1.0, max_new_tokens: int = 64, batch_size: int = 128,
                    sampler=None) -> tuple[Samples, list[list[dict]]]:
    """Multi-turn episodes: the policy speaks, the env answers (`env.step`), until the env ends the
    episode or `max_turns` assistant turns are spent. Returns one token sequence per episode:

        prompt | assistant turn 1 | observation 1 | assistant turn 2 | ...

    `completion_mask` is 1 on assistant tokens only; observations are in `completion_attention` (read
    as context, never trained on). Observation tokens are the chat template's own rendering of the new
    messages, appended to exactly the text rendered so far, so the student and a teacher re-scoring the
    whole interaction see the same tokens. Also returns each episode's messages.
    """
    n = len(tasks)
    prompts = [encode_prompt(tokenizer, t.messages) for t in tasks]
    history = [list(t.messages) for t in tasks]
    rendered = [prompt_text(tokenizer, t.messages) for t in tasks]
    ids: list[list[int]] = [[] for _ in range(n)]
    trained: list[list[int]] = [[] for _ in range(n)]
    logp: list[list[float]] = [[] for _ in range(n)]
    truncated = [False] * n
    active = list(range(n))
    for _ in range(max_turns):
        if not active:
            break
        s = (sampler or sample)(model, tokenizer, [prompts[i] + ids[i] for i in active], temperature=temperature, top_p=top_p,
                   max_new_tokens=max_new_tokens, batch_size=batch_size)
        still = []
        for j, i in enumerate(active):
            k = int(s.completion_mask[j].sum())
            turn = s.completion_ids[j, :k].tolist()
            ids[i] += turn
            trained[i] += [1] * k
            logp[i] += s.sampler_logprobs[j, :k].tolist()
            history[i].append({"role": "assistant", "content": s.completions[j]})
            rendered[i] += tokenizer.decode(turn, skip_special_tokens=False)
            if bool(s.truncated[j]):
                truncated[i] = True
                continue
            observation = env_call(env, "step", [tasks[i]], lambda: env.step(tasks[i], history[i]))
            if not observation:
                continue
            history[i] += observation
            full = prompt_text(tokenizer, history[i])
            if not full.startswith(rendered[i]):
                raise ValueError("the chat template does not render a conversation as a prefix of its continuation; "
                                 "multi-turn episodes need one that does (e.g. ChatML)")
            obs = tokenizer(full[len(rendered[i]):], add_special_tokens=False)["input_ids"]
            ids[i] += obs
            trained[i] += [0] * len(obs)
            logp[i] += [0.0] * len(obs)
            rendered[i] = full
            still.append(i)
        active = still
    pad = tokenizer.pad_token_id
    P, C = max(map(len, prompts)), max(max(map(len, ids)), 1)
    prompt_ids, prompt_mask = left_pad(prompts, pad)
    out = Samples(prompt_ids=prompt_ids, prompt_mask=prompt_mask,
                  completion_ids=torch.full((n, C), pad, dtype=torch.long),
                  completion_mask=torch.zeros(n, C, dtype=torch.long), sampler_logprobs=torch.zeros(n, C),
                  completions=[tokenizer.decode(x, skip_special_tokens=True) for x in ids],
                  truncated=torch.tensor(truncated), completion_attention=torch.zeros(n, C, dtype=torch.long))
    for i in range(n):
        L = len(ids[i])
        out.completion_ids[i, :L] = torch.tensor(ids[i], dtype=torch.long)
        out.completion_mask[i, :L] = torch.tensor(trained[i], dtype=torch.long)
        out.sampler_logprobs[i, :L] = torch.tensor(logp[i])
        out.completion_attention[i, :L] = 1
    assert out.prompt_ids.shape[1] == P
    return out, history


def _which(tasks: Sequence[Task]) -> str:
    """The tasks an env method was called on, for its error message: "task 'a'", "4 completions of tasks 'a', 'b'"."""
    if len(tasks) == 1:
        return f"task '{tasks[0].id}'"
    ids = list(dict.fromkeys(t.id for t in tasks))
    shown = ", ".join(f"'{i}'" for i in ids[:3])
    return f"{len(tasks)} completions of tasks {shown}{', ...' if len(ids) > 3 else ''}"


def env_call(env: Env, method: str, tasks: Sequence[Task], call: Callable[[], Any]) -> Any:
    """`call()`, one of the env's methods on `tasks`; anything it raises becomes an EnvError of one line:
    `MyEnv.score(task 'unit-3') raised ValueError: ...` (the original stays its cause, for a traceback)."""
    try:
        return call()
    except LopdError:
        raise
    except Exception as e:
        text = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise EnvError(f"{type(env).__name__}.{method}({_which(tasks)}) raised {type(e).__name__}"
                       f"{': ' + text if text else ''}") from e


def checked_score(env: Env, method: str, task: Task, score: Any) -> Score:
    """`score` if it is a Score (reward, success, feedback) with a finite real reward; an EnvError naming the
    method and the task otherwise (a NaN reward would poison every advantage of its group)."""
    reward = getattr(score, "reward", None)
    where = f"{type(env).__name__}.{method}(task '{task.id}')"
    if not (hasattr(score, "success") and hasattr(score, "feedback")) or isinstance(reward, bool) \
            or not isinstance(reward, numbers.Real):
        raise EnvError(f"{where} returned {type(score).__name__} {str(score)[:80]!r}, not a Score(reward, success, "
                       f"feedback) with a number as its reward")
    if not math.isfinite(reward):
        raise EnvError(f"{where} returned the non-finite reward {reward}: rewards must be finite numbers")
    return score


def score_all(env: Env, tasks: Sequence[Task], completions: Sequence[str]) -> list[Score]:
    """The env's Score of every (task, completion), through its batched path when it has one
    (`score_many`: HumanEval's parallel sandboxes), else one at a time; each checked (`checked_score`)."""
    if hasattr(env, "score_many"):
        scores = env_call(env, "score_many", tasks, lambda: list(env.score_many(list(zip(tasks, completions)))))
        if len(scores) != len(tasks):
            raise EnvError(f"{type(env).__name__}.score_many({_which(tasks)}) returned {len(scores)} scores for "
                           f"{len(tasks)} completions")
        return [checked_score(env, "score_many", t, s) for t, s in zip(tasks, scores)]
    return [checked_score(env, "score", t, env_call(env, "score", [t], lambda: env.score(t, c)))
            for t, c in zip(tasks, completions)]


def sample_and_score(model, tokenizer, env: Env, tasks: Sequence[Task], *, group_size: int = 1,
                     temperature: float = 1.0, top_p: float = 1.0, max_new_tokens: int = 64, batch_size: int = 128,
                     max_turns: int = 4, timer=None, seeds: Sequence[int] | None = None,
                     first_group: int = 0, sampler=None) -> RolloutBatch:
    """`group_size` trajectories per task, sampled from the policy (temperature 0: greedy) and scored by
    the env, as a `RolloutBatch`; the one path of training rollouts and held-out evaluation. Envs with a
    `step` method run as multi-turn episodes; the others answer in one completion.

    `seeds`: one per task; each group is then sampled on its own, under its seed (the global RNG is left as
    it was), so a group's samples do not depend on which other tasks share the batch or the rank.
    `first_group`: the group id of the first task (a rank's share of a step keeps the global ids).
    `sampler`: a function with `sample`'s signature that draws the completions (a vLLM engine's `sample`)."""
    from contextlib import nullcontext

    phase = timer or (lambda name: nullcontext())
    owners = [t for t in tasks for _ in range(group_size)]
    kw = dict(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, batch_size=batch_size)

    def draw(some: Sequence[Task]):
        if hasattr(env, "step"):
            return sample_episodes(model, tokenizer, env, [t for t in some for _ in range(group_size)],
                                   max_turns=max_turns, sampler=sampler, **kw)
        prompts = [encode_prompt(tokenizer, t.messages) for t in some]
        return (sampler or sample)(model, tokenizer, [p for p in prompts for _ in range(group_size)], **kw), None

    with phase("rollout"):
        if seeds is None:
            s, episodes = draw(tasks)
        else:
            parts = []
            for task, seed in zip(tasks, seeds):
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(seed)
                    parts.append(draw([task]))
            s = _concat([p[0] for p in parts], tokenizer.pad_token_id)
            episodes = None if parts[0][1] is None else [h for p in parts for h in p[1]]
    with phase("score"):
        if episodes is not None:
            scores = [checked_score(env, "score_episode", t, env_call(env, "score_episode", [t],
                                                                      lambda: env.score_episode(t, h)))
                      for t, h in zip(owners, episodes)]
        else:
            scores = score_all(env, owners, s.completions)
    groups = torch.arange(first_group, first_group + len(tasks)).repeat_interleave(group_size)
    return RolloutBatch(**vars(s), tasks=owners, group=groups,
                        rewards=torch.tensor([float(sc.reward) for sc in scores], dtype=torch.float32),
                        success=torch.tensor([sc.success for sc in scores], dtype=torch.bool),
                        feedback=[sc.feedback for sc in scores])


def collect(model, tokenizer, env: Env, tasks: Sequence[Task], cfg, timer=None, seeds: Sequence[int] | None = None,
            first_group: int = 0, sampler=None) -> RolloutBatch:
    """Training rollouts: `sample_and_score` with a `RolloutConfig`'s settings."""
    return sample_and_score(model, tokenizer, env, tasks, group_size=cfg.group_size, temperature=cfg.temperature,
                            top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens, batch_size=cfg.batch_size,
                            max_turns=cfg.max_turns, timer=timer, seeds=seeds, first_group=first_group,
                            sampler=sampler)
