"""Rollout engines: what draws a step's training rollouts (`rollout.engine`). The loop only calls

    batch, metrics = engine.rollouts(model, tasks, timer, seeds=..., first_group=...)
    engine.close()

`HFGenerate` (hf, the default) samples with Hugging Face `generate` in the trainer's process
(`lopd.rollout.collect`). `RolloutSync` (vllm): a vLLM server (started here or pointed to by URL,
`lopd.engines.vllm`) sampling the policy through its OpenAI-compatible completions endpoint, with LoRA /
full-weight sync and a check that it samples the current policy; its own phases (`sync`, `correct`) are
timed inside `rollouts`. The client needs only the standard library and torch; vLLM itself runs in the
server's own interpreter (`scripts/setup_vllm_venv.sh` builds `.venv-vllm`), so nothing here imports `vllm`.
"""

from __future__ import annotations

import torch

from lopd.models import is_lora
from lopd.rollout import collect
from lopd.schema import RolloutEngine, head_dtype_of


class HFGenerate:
    """Rollouts by Hugging Face `generate` on the trainer's own model (`rollout.engine: hf`)."""

    def __init__(self, cfg, tokenizer, env):
        self.cfg, self.tokenizer, self.env = cfg, tokenizer, env

    def rollouts(self, model, tasks, timer, *, seeds=None, first_group: int = 0):
        """The step's rollouts of `tasks` (`rollout.collect`) and the engine's metrics (none)."""
        return collect(model, self.tokenizer, self.env, tasks, self.cfg.rollout, timer, seeds=seeds,
                       first_group=first_group), {}

    def close(self) -> None:
        pass


class RolloutSync:
    """A vLLM engine as the loop uses it: `sample` (rollout.sample's contract), `sync(model)` before each
    step's rollouts (LoRA adapters hot-loaded in place, full weights reloaded), with the check that the
    server samples the current policy, and `correct(model, batch)`: the trainer's log-probs of the sampled
    tokens replace the sampler's (the PPO ratio's denominator), and truncated importance weights
    min(pi_trainer / pi_sampler, is_cap) weight GRPO's per-token loss, since the two no longer agree exactly."""

    def __init__(self, cfg, model, tokenizer, env, model_folder: str, probe_ids: list[int]):
        from lopd.engines.vllm import VLLMEngine, VLLMServer, vllm_python

        r = cfg.rollout
        self.cfg, self.tokenizer, self.env, self.syncs, self.probe_ids = cfg, tokenizer, env, 0, probe_ids
        if r.vllm_url:
            self.engine = VLLMEngine(VLLMServer.connect(r.vllm_url), tokenizer)
        else:
            lora = cfg.model.lora
            self.engine = VLLMEngine.launch(model_folder, tokenizer, python=vllm_python(r.vllm_python or None),
                                            dtype=r.vllm_dtype, enable_lora=is_lora(model),
                                            max_lora_rank=max(lora.r, 8), full_weight_sync=not is_lora(model),
                                            seed=cfg.train.seed, max_model_len=4096,
                                            threads=r.vllm_threads or None)
        self.probe: list[int] | None = None

    def rollouts(self, model, tasks, timer, *, seeds=None, first_group: int = 0):
        """Sync the server to `model`, sample `tasks` through it, then correct the sampler's log-probs."""
        with timer("sync"):
            metrics = self.sync(model, self.probe_ids)
        batch = collect(model, self.tokenizer, self.env, tasks, self.cfg.rollout, timer, seeds=seeds,
                        first_group=first_group, sampler=self.sample)
        with timer("correct"):
            metrics.update(self.correct(model, batch, self.cfg.train.micro_batch_size or 16, head_dtype_of(self.cfg)))
        return batch, metrics

    def sample(self, *args, **kwargs):
        return self.engine.sample(*args, **kwargs)

    def sync(self, model, probe_ids: list[int]) -> dict[str, float]:
        from lopd.engines.vllm import trainer_prompt_logprobs

        if self.probe is None:  # the initial policy's log-probs of a fixed prompt, before any sync
            self.probe = probe_ids
            self.engine.prompt_logprobs(self.probe)
        self.engine.sync(model)
        self.syncs += 1
        every = self.cfg.rollout.vllm_verify_every
        if self.syncs <= 2 or (every and self.syncs % every == 0):  # the 2nd sync is the first of moved weights
            report = self.engine.verify_sync(self.probe, trainer_prompt_logprobs(model, self.probe))
            return {"rollout/sync_logprob_gap": report["mean_abs_diff"]}
        return {}

    @torch.no_grad()
    def correct(self, model, batch, micro_batch: int, head_dtype) -> dict[str, float]:
        from lopd.engines.vllm import truncated_importance_weights
        from lopd.tokens import score_completions

        device = next(model.parameters()).device
        parts = []
        for index in torch.arange(len(batch)).split(micro_batch):
            mb = batch.select(index).to(device)
            stats = score_completions(model, mb.prompt_ids, mb.prompt_mask, mb.completion_ids, mb.completion_mask,
                                      completion_attention=mb.completion_attention,
                                      temperature=self.cfg.rollout.temperature, head_dtype=head_dtype)
            parts.append(stats.logprobs().cpu())
        trainer = torch.cat(parts)  # [B, T]
        mask = batch.completion_mask.float()
        gap = ((trainer - batch.sampler_logprobs).abs() * mask).sum() / mask.sum().clamp(min=1)
        batch.is_weights = truncated_importance_weights(trainer, batch.sampler_logprobs, mask, self.cfg.rollout.is_cap)
        batch.sampler_logprobs = trainer
        w = (batch.is_weights * mask).sum() / mask.sum().clamp(min=1)
        return {"rollout/sampler_trainer_gap": float(gap), "rollout/is_weight_mean": float(w)}

    def close(self) -> None:
        self.engine.close()


def rollout_engine(cfg, model, tokenizer, env, probe_ids: list[int]) -> HFGenerate | RolloutSync:
    """The configured engine (`rollout.engine`); `probe_ids`: a fixed prompt whose log-probs check that a
    server samples the current policy."""
    from lopd.models import resolve_model

    if cfg.rollout.engine == RolloutEngine.hf:
        return HFGenerate(cfg, tokenizer, env)
    return RolloutSync(cfg, model, tokenizer, env, str(resolve_model(cfg.model.name)), probe_ids)
