"""The self-teacher and the reference: models that re-score the student's own completions.

Every self-distillation method needs the same thing from its teacher: the log-probabilities (and, for
the full-vocabulary estimators, the hidden states) that the teacher assigns to the tokens the student
sampled, at every visited prefix, while reading a privileged context the student did not see:

    teacher.score(batch)                              context-free (the GRPO reference, LOPD's pi_0)
    teacher.score(batch, contexts=texts)              a text context at the end of the system message
    teacher.score(batch, contexts=texts, latents=L)   continuous latent tokens spliced in (LOPD)

Weights (`algorithm.distill.teacher`):
    frozen  the initial weights. LoRA: the same module with its adapter disabled (no second copy in
            memory); full fine-tune: one frozen copy, shared by every frozen view of the same policy.
    ema     an exponential moving average of the student, updated after every optimizer step.
    live    the student's current weights, detached.
Gradients never reach a teacher's weights; they may reach its inputs (LOPD's latent tokens).
An algorithm builds the teachers it needs in `setup`; the training loop never sees them. A full fine-tune's
frozen or EMA teacher keeps a full weight copy (`lopd.models.weight_copy`), which the memory planner counts
and `train.fsdp` shards with the policy.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Sequence

import torch
from torch import Tensor, nn

from lopd.models import base_model, checkpointing_on, frozen_copy, is_lora, weight_copy
from lopd.prompts import PLACEHOLDER, context_span, encode_prompt
from lopd.rollout import left_pad
from lopd.schema import LatentPosition, TeacherWeights
from lopd.tokens import Latents, TokenStats, score_completions

if TYPE_CHECKING:
    from lopd.rollout import RolloutBatch


@dataclass
class LatentSlots:
    """K continuous tokens for the teacher, built by an algorithm (LOPD's composer).

    values: [B, K, H]. With `over_context`, slot k is the embedding of the k-th token of the row's text
    context plus values[:, k] (slots beyond the context's length are absent: masked out, no position), so
    values = 0 reproduces the text context exactly. Without it, slot k is values[:, k] itself and every
    slot of a row that has a context is present; the context's text only marks where the slots go.
    position: `in_context` (where the text context stands: the end of the system message) or `prefix`
    (before the whole chat template).
    """

    values: Tensor  # [B, K, H]
    over_context: bool = True
    position: LatentPosition = LatentPosition.in_context


class Teacher:
    """Base class: a view of some weights that scores completions under a context."""

    trained = False  # whether its weights change during training (then checkpoints hold them)

    def __init__(self, tokenizer=None, temperature: float = 1.0, head_dtype: torch.dtype | None = torch.float32):
        self.tokenizer, self.temperature, self.head_dtype = tokenizer, temperature, head_dtype

    @contextlib.contextmanager
    def active(self) -> Iterator[nn.Module]:
        """The module to run, with the teacher's weights in place."""
        raise NotImplementedError
        yield  # pragma: no cover

    def after_step(self) -> None:
        """Called after every optimizer step of the student (the EMA moves here)."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    # ------------------------------------------------------------------ scoring

    def score(self, batch: "RolloutBatch", contexts: Sequence[str | None] | None = None) -> TokenStats:
        """The teacher's TokenStats over the batch's completion tokens, reading `contexts[i]` (None: no
        context) at the end of row i's system message. Its output head is evaluated later, outside
        `active()`, so the stats carry a weights-detached head."""
        if contexts is None:
            ids, mask = batch.prompt_ids, batch.prompt_mask
        else:
            prompts = [encode_prompt(self.tokenizer, t.messages, c) for t, c in zip(batch.tasks, contexts)]
            ids, mask = left_pad(prompts, self.tokenizer.pad_token_id)
        with self.active() as model:
            stats = score_completions(model, ids, mask, batch.completion_ids, batch.completion_mask,
                                      completion_attention=batch.completion_attention, temperature=self.temperature,
                                      head_dtype=self.head_dtype)
        return stats.weights_detached()

    def score_latent(self, batch: "RolloutBatch", contexts: Sequence[str | None],
                     latents: LatentSlots, checkpoint_layers: bool = False) -> tuple[TokenStats, Tensor]:
        """The teacher's TokenStats with K latent slots in its prompt (gradients flow into
        `latents.values`), and [B] the number of context tokens under the slots of each row.
        `checkpoint_layers`: recompute each decoder layer in the backward pass instead of keeping its
        activations (the teacher's forward then costs one more forward, and far less memory)."""
        prompt = latent_prompt(self.tokenizer, batch.tasks, contexts, latents)
        with self.active() as model, activation_checkpointing(model, checkpoint_layers):
            stats = score_completions(model, prompt.ids, prompt.mask, batch.completion_ids, batch.completion_mask,
                                      completion_attention=batch.completion_attention, temperature=self.temperature,
                                      latents=prompt.latents(model, latents), head_dtype=self.head_dtype)
        return stats.weights_detached(), prompt.length

    @torch.no_grad()
    def generate_latent(self, tasks, contexts: Sequence[str | None], latents: LatentSlots,
                        max_new_tokens: int = 64) -> list[str]:
        """What the teacher answers, greedily, reading the slots in its prompt (the privilege probe's greedy
        success with a latent context)."""
        from lopd.rollout import _eos_ids
        from lopd.tokens import decoder_and_head, positions, splice

        prompt = latent_prompt(self.tokenizer, tasks, contexts, latents)
        with self.active() as model:
            device = next(model.parameters()).device
            decoder, _ = decoder_and_head(model)
            embeds = decoder.get_input_embeddings()(prompt.ids.to(device))
            embeds, mask = splice(embeds, prompt.mask.to(device), prompt.latents(model, latents))
            was_training = model.training
            model.eval()
            out = model.generate(inputs_embeds=embeds, attention_mask=mask, position_ids=positions(mask),
                                 max_new_tokens=max_new_tokens, do_sample=False, temperature=None, top_p=None,
                                 top_k=None, eos_token_id=_eos_ids(self.tokenizer, model),
                                 pad_token_id=self.tokenizer.pad_token_id)
            model.train(was_training)
        return self.tokenizer.batch_decode(out, skip_special_tokens=True)


@dataclass
class LatentPrompt:
    """The teacher's prompts with room for latent slots: each row's ids with the context's text cut out
    (in_context) or the plain prompt (prefix), where the slots go, and the context tokens under them."""

    ids: Tensor  # [B, P] left-padded
    mask: Tensor  # [B, P]
    at: Tensor  # [B] the column before which each row's slots go
    spans: list[list[int]]  # [B][<=K] the context's token ids under the slots (over_context only)
    over: bool
    has_context: list[bool]

    @property
    def length(self) -> Tensor:
        """[B] context tokens under the slots."""
        return torch.tensor([len(s) for s in self.spans])

    def latents(self, model: nn.Module, slots: LatentSlots) -> Latents:
        """The slots as `Latents` for `score_completions`/`splice`: over the context's token embeddings
        (`over_context`: values added to them, absent past the context) or K slots of their own."""
        B, K, _ = slots.values.shape
        device = slots.values.device
        if self.over:
            span_ids = torch.zeros(B, K, dtype=torch.long)
            for b, s in enumerate(self.spans):
                span_ids[b, :len(s)] = torch.tensor(s, dtype=torch.long)
            base = model.get_input_embeddings()(span_ids.to(device)).detach()  # [B, K, H]
            present = torch.arange(K)[None] < self.length[:, None]  # [B, K]
            values = torch.where(present.to(device)[..., None], base + slots.values.to(base.dtype),
                                 slots.values.to(base.dtype))
        else:
            present = torch.tensor(self.has_context)[:, None].expand(B, K)
            values = slots.values
        return Latents(values, present.to(device), self.at.to(device))


def latent_prompt(tokenizer, tasks, contexts: Sequence[str | None], slots: LatentSlots) -> LatentPrompt:
    """Where K slots go in each task's prompt: in place of its context's text (the end of the system message,
    `in_context`) or before the chat template (`prefix`)."""
    K = slots.values.shape[1]
    over, in_context = slots.over_context, slots.position == LatentPosition.in_context
    rows, starts, spans = [], [], []
    for task, text in zip(tasks, contexts):
        marker = text if text is not None or over else PLACEHOLDER  # where the slots go
        ids, s, e = context_span(tokenizer, task.messages, marker)
        spans.append(ids[s:e][:K] if text is not None and over else [])
        rows.append(ids[:s] + ids[e:] if in_context else encode_prompt(tokenizer, task.messages))
        starts.append(s if in_context else 0)
    ids, mask = left_pad(rows, tokenizer.pad_token_id)
    at = torch.tensor(starts) + ((mask == 0).sum(-1) if in_context else 0)  # [B] slot position in the row
    return LatentPrompt(ids, mask, at, spans, over, [c is not None for c in contexts])


@contextlib.contextmanager
def activation_checkpointing(model: nn.Module, on: bool) -> Iterator[None]:
    """Hugging Face's per-layer activation checkpointing for the forwards inside (non-reentrant, so the
    gradient still reaches inputs_embeds), restored afterwards."""
    if not on:
        yield
        return
    base = base_model(model)
    was_training = base.training
    was_on = checkpointing_on(base)
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    base.train()  # Hugging Face checkpoints only in training mode (dropout stays whatever the config says)
    try:
        yield
    finally:
        if not was_on:
            base.gradient_checkpointing_disable()
        base.train(was_training)


class FrozenTeacher(Teacher):
    """The backbone's initial weights, never trained: the GRPO reference, LOPD's pi_0, the default teacher.
    LoRA: the same module with its adapter disabled; full fine-tune: the policy's shared frozen copy."""

    def __init__(self, policy: nn.Module, tokenizer=None, temperature: float = 1.0, head_dtype=torch.float32):
        super().__init__(tokenizer, temperature, head_dtype)
        self._shared = is_lora(policy)
        self.model = policy if self._shared else frozen_copy(policy)

    @contextlib.contextmanager
    def active(self) -> Iterator[nn.Module]:
        if self._shared:
            with self.model.disable_adapter():
                yield self.model
        else:
            yield self.model


class EMATeacher(Teacher):
    """An exponential moving average of the student: theta_T <- (1 - rate) theta_T + rate theta.

    Full fine-tune: a frozen copy whose weights are lerped after every optimizer step. LoRA: a second
    adapter ("ema") on the same base weights, switched in for the teacher's forward, so the backward
    pass (to a latent prefix) sees the EMA tensors too.
    """

    trained = True
    ADAPTER = "ema"

    def __init__(self, policy: nn.Module, rate: float, tokenizer=None, temperature: float = 1.0, head_dtype=torch.float32):
        super().__init__(tokenizer, temperature, head_dtype)
        self.policy, self.rate, self._lora = policy, rate, is_lora(policy)
        if self._lora:
            policy.add_adapter(self.ADAPTER, policy.peft_config[policy.active_adapter])
            self._sync_pairs(copy_now=True)
        else:
            self.model = weight_copy(policy)

    def _pairs(self) -> list[tuple[Tensor, Tensor]]:
        """(ema tensor, student tensor) for every trained weight."""
        if not self._lora:
            student = dict(self.policy.named_parameters())
            return [(p, student[n]) for n, p in self.model.named_parameters()]
        active = self.policy.active_adapter
        named = dict(self.policy.named_parameters())
        return [(named[n], named[n.replace(f".{self.ADAPTER}.", f".{active}.")])
                for n in named if f".{self.ADAPTER}." in n]

    def _sync_pairs(self, copy_now: bool) -> None:
        for ema, student in self._pairs():
            ema.requires_grad_(False)
            if copy_now:
                ema.data.copy_(student.data)

    @contextlib.contextmanager
    def active(self) -> Iterator[nn.Module]:
        if not self._lora:
            yield self.model
            return
        student_adapter = self.policy.active_adapter
        self.policy.set_adapter(self.ADAPTER)
        self._sync_pairs(copy_now=False)  # set_adapter marks the active adapter trainable: undo it
        try:
            yield self.policy
        finally:
            self.policy.set_adapter(student_adapter)

    @torch.no_grad()
    def after_step(self) -> None:
        for ema, student in self._pairs():
            ema.lerp_(student.to(ema.dtype), self.rate)

    def state_dict(self) -> dict:
        return {f"{i}": ema.detach().clone() for i, (ema, _) in enumerate(self._pairs())}  # shards under FSDP

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        from lopd.fsdp import copy_full_

        if state:
            for i, (ema, _) in enumerate(self._pairs()):
                copy_full_(ema.data, state[f"{i}"])


class LiveTeacher(Teacher):
    """The student's current weights, detached: no gradient reaches them through the teacher."""

    def __init__(self, policy: nn.Module, tokenizer=None, temperature: float = 1.0, head_dtype=torch.float32):
        super().__init__(tokenizer, temperature, head_dtype)
        self.policy = policy

    @contextlib.contextmanager
    def active(self) -> Iterator[nn.Module]:
        trained = [p for p in self.policy.parameters() if p.requires_grad]
        for p in trained:  # autograd records requires_grad at forward time: these stay out of the graph
            p.requires_grad_(False)
        try:
            yield self.policy
        finally:
            for p in trained:
                p.requires_grad_(True)


def build_teacher(kind: TeacherWeights, policy: nn.Module, *, ema_rate: float = 0.05, tokenizer=None,
                  temperature: float = 1.0, head_dtype: torch.dtype | None = torch.float32) -> Teacher:
    """The self-teacher's weights (`algorithm.distill.teacher`): frozen, ema or live."""
    if kind == TeacherWeights.frozen:
        return FrozenTeacher(policy, tokenizer, temperature, head_dtype)
    if kind == TeacherWeights.ema:
        return EMATeacher(policy, ema_rate, tokenizer, temperature, head_dtype)
    if kind == TeacherWeights.live:
        return LiveTeacher(policy, tokenizer, temperature, head_dtype)
    raise ValueError(f"teacher weights '{kind}' are not one of {', '.join(TeacherWeights)}")
