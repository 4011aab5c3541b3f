"""Side-by-side step time and peak memory of lopd and TRL on the same work (SmolLM2-135M-Instruct on CPU).

Pairs (lopd config | TRL class):
    grpo   lopd GRPO (`--config grpo`, reference KL off)          | trl.GRPOTrainer (beta 0)
    sdpo   lopd SDPO (sampled-token estimator, EMA teacher)        | trl.experimental.sdpo.SDPOTrainer
                                                                     (distillation_mode sampled_token, teacher ema)
    opsd   lopd OPSD (full-vocabulary reverse KL, frozen teacher)  | trl.DistillationTrainer (beta 1 = reverse KL,
                                                                     the same checkpoint as teacher)
    lopd   lopd LOPD (`--config lopd`, defaults)                   | none in TRL: compared with lopd GRPO instead

The same work on both sides: SmolLM2-135M-Instruct from `lopd.models.smollm2_folder()` (one HF folder for
both), float32 weights, full fine-tune, AdamW (betas 0.9/0.99, no weight decay, constant lr, grad clip 1),
no gradient checkpointing, `--tasks` ToolWorld `train` prompts per step (the same tasks, in lopd's order,
rendered by lopd's chat template: TRL's tokenisation is checked to give exactly `encode_prompt`'s ids) x
`--group` samples at temperature 1, exactly `--new-tokens` new tokens per sample on both sides (EOS is
suppressed until then: `min_new_tokens`), the tokens generated per step counted and reported, one
forward/backward of all `tasks x group` sequences per optimizer step (`--micro-batch 0`), and the reward
of lopd's ToolWorld checker (`ToolWorld.score(task, completion).reward`, wrapped as a TRL reward function).

Per process (`--system lopd|trl --pair P`): `--steps` optimizer steps, the first `--warmup` not measured;
prints one JSON line: per-step wall time (median over the measured steps), its split into generation,
scoring and the rest ("train": context, forward/backward, optimizer), tokens generated per step, and the
process's peak RSS (`resource.getrusage(RUSAGE_SELF).ru_maxrss`, set-up included).
    lopd: `lopd.loop.build/restore/fit` with overrides; a step is the sum of the step row's `time/*` phases
          in metrics.jsonl (rollout + score + context + update + remember). No evaluation runs (env.eval_splits
          is empty) and no checkpoint is written (checkpoint_every 1000; the budget is one step more than
          `--steps` and `fit(stop_after=--steps)` stops before the final checkpoint and evaluation).
    trl:  a TrainerCallback times each optimizer step from `on_step_begin` to `on_step_end` (generation,
          rewards, loss, backward, clip, optimizer and scheduler step; logging is after `on_step_end`);
          `model.generate` and `trainer._calculate_rewards` are wrapped to time generation and scoring.

Driver (no `--system`): for each pair, fresh processes A B A B (`--repeats` times: lopd with .venv/bin/python,
TRL with .venv-trl/bin/python; for `lopd` the B side is lopd GRPO), OMP_NUM_THREADS=`--threads` and
torch.set_num_threads(`--threads`) in each, then writes the JSON (every process's result and the medians:
benchmarks/trl_compare.json) and a markdown table (the `results` block of benchmarks/trl_compare.md; a smoke
run writes its `smoke` block and keeps its JSON under runs/): throughput ratio = TRL step / lopd step (> 1:
lopd is faster), peak RSS ratio = lopd / TRL (< 1: lopd uses less), per pair, from the medians over the repeats.

    bash scripts/setup_trl_venv.sh                         # once: .venv-trl
    .venv/bin/python benchmarks/trl_compare.py              # the full measurement (a quiet machine; ~1.5 h)
    .venv/bin/python benchmarks/trl_compare.py --smoke      # the harness end to end in ~4 min (not figures)
    .venv-trl/bin/python benchmarks/trl_compare.py --system trl --pair grpo --steps 4 --warmup 1
    .venv/bin/python benchmarks/trl_compare.py --system lopd --pair grpo --steps 2 --warmup 1 \
        --profile benchmarks/profile/grpo.md                # where a step's time goes, per operator family
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAIRS = ("grpo", "sdpo", "opsd", "lopd")
LOPD_PYTHON = ROOT / ".venv" / "bin" / "python"
TRL_PYTHON = ROOT / ".venv-trl" / "bin" / "python"

# lopd's side of each pair: a bundled config and the overrides that make it the method the pair names.
LOPD_METHOD = {
    "grpo": ("grpo", ["algorithm.pg.kl_coef=0.0"]),
    "sdpo": ("sdpo", ["algorithm.distill.estimator=sampled", "algorithm.distill.teacher=ema",
                      "algorithm.distill.ema_rate=0.05", "algorithm.distill.pg_weight=0.0"]),
    "opsd": ("opsd", ["algorithm.distill.estimator=full", "algorithm.distill.teacher=frozen",
                      "algorithm.distill.pg_weight=0.0"]),
    "lopd": ("lopd", []),
}
TRL_CLASS = {"grpo": "trl.GRPOTrainer", "sdpo": "trl.experimental.sdpo.SDPOTrainer",
             "opsd": "trl.DistillationTrainer", "lopd": None}


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def model_folder(arg: str) -> str:
    if arg:
        return arg
    from lopd.models import smollm2_folder

    return str(smollm2_folder())


def summarise(steps: list[dict], warmup: int) -> dict:
    measured = steps[warmup:]
    if not measured:
        raise SystemExit(f"no measured step: {len(steps)} steps ran and --warmup is {warmup}")
    keys = [k for k in ("step_s", "gen_s", "score_s", "train_s", "tokens") if all(k in s for s in measured)]
    return {f"median_{k}": statistics.median(s[k] for s in measured) for k in keys}


# ------------------------------------------------------------------------------------------------ lopd side


def run_lopd(a) -> dict:
    import torch

    torch.set_num_threads(a.threads)
    import lopd
    from lopd import load_config
    from lopd.config import to_yaml
    from lopd.loop import fit
    from lopd.session import build, restore

    folder = model_folder(a.model)
    name, method = LOPD_METHOD[a.pair]
    per_step = a.tasks * a.group
    tmp = tempfile.mkdtemp(prefix=f"trl_compare_lopd_{a.pair}_")
    overrides = [
        f"model.name={folder}", "model.dtype=float32", "model.lora.enabled=false", "env.name=toolworld",
        "env.train_split=train", "env.eval_splits=[]", "eval.every_rollouts=0", "eval.max_tasks=1",
        f"rollout.tasks_per_step={a.tasks}", f"rollout.group_size={a.group}", f"rollout.max_new_tokens={a.new_tokens}",
        "rollout.temperature=1.0", "rollout.top_p=1.0", f"rollout.batch_size={per_step}", "rollout.engine=hf",
        f"train.max_rollouts={(a.steps + 1) * per_step}",  # one step more than run: fit stops before the final save
        *([f"train.micro_batch_size={a.micro_batch or per_step}", "train.micro_batch_tokens=1000000000"]
          if not a.memory_budget else  # lopd's own planner: micro-batches sized to the budget
          ["train.micro_batch_size=0", "train.micro_batch_tokens=0", f"train.memory_budget_gib={a.memory_budget}"]),
        "train.activation_checkpointing=false", "train.epochs_per_batch=1", "train.minibatches=1",
        f"train.threads={a.threads}", "train.device=cpu", f"train.seed={a.seed}",
        f"optim.lr={a.lr}", "optim.weight_decay=0.0", "optim.beta1=0.9", "optim.beta2=0.99", "optim.grad_clip=1.0",
        "optim.warmup_steps=0", "run.checkpoint_every=1000", "run.tensorboard=false", "run.progress=false",
        f"run.dir={tmp}/run", f"optim.fused={str(a.fused).lower()}",
    ] + method + a.lopd_set
    cfg = load_config(name, overrides)
    t0 = time.perf_counter()
    session = build(cfg)
    # exactly `new_tokens` new tokens per sample, as on the TRL side (generate reads min_new_tokens from here)
    session.model.generation_config.min_new_tokens = a.new_tokens
    assert not session.model.is_activation_checkpointing and session.model.dtype == torch.float32
    try:
        session.resuming = False
        session.run.config_path.write_text(to_yaml(cfg))
        state = restore(session)
        setup_s, setup_rss = time.perf_counter() - t0, peak_rss_mib()
        if a.profile:  # the measured steps under torch.profiler: the warm-up first, outside it
            fit(session, state, stop_after=a.warmup, quiet=True)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                fit(session, state, stop_after=a.steps - a.warmup, quiet=True)
            write_profile(prof, Path(a.profile), a)
        else:
            fit(session, state, stop_after=a.steps, quiet=True)
    finally:
        session.run.release()
    rows = [json.loads(line) for line in open(Path(tmp) / "run" / "metrics.jsonl")]
    train_rows = [r for r in rows if str(r.get("kind", "")).startswith("train")]
    assert not any("time/eval" in r or "time/checkpoint" in r for r in train_rows), "evaluation or a checkpoint ran"
    steps, tokens_before = [], 0
    for r in train_rows:
        t = {k[5:]: v for k, v in r.items() if k.startswith("time/")}
        gen, score = t.get("rollout", 0.0), t.get("score", 0.0)
        step = sum(t.values())
        steps.append({"step_s": step, "gen_s": gen, "score_s": score, "train_s": step - gen - score,
                      "phases": t, "tokens": r["tokens"] - tokens_before, "reward_mean": r.get("reward/mean"),
                      # what the update had to do: the rows it forwarded, those with a context, the mixed groups
                      **{k.split("/")[1]: r[k] for k in ("update/rows_forwarded", "context/coverage",
                                                         "reward/mixed_groups") if k in r}})
        tokens_before = r["tokens"]
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)
    return {"system": "lopd", "pair": a.pair, "method": f"lopd {name} " + " ".join(method), "steps": steps,
            "setup_s": setup_s, "setup_peak_rss_mib": setup_rss, "peak_rss_mib": peak_rss_mib(),
            "versions": {"lopd": lopd.__version__, "torch": torch.__version__, **_versions("transformers")}}


# operator families of a transformer step: what the model's own arithmetic is, and what is not
FAMILIES = (
    ("matmul (linear layers, output head; forward and backward)", ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear",
                                                                    "aten::matmul", "aten::baddbmm")),
    ("attention (scaled dot product, its backward)", ("scaled_dot_product", "_flash_attention", "_efficient_attention")),
    ("softmax / log-softmax / logsumexp (loss and sampling)", ("softmax", "logsumexp", "log_softmax")),
    ("elementwise and norms (activations, RMSNorm, rotary, residual adds)", ("aten::mul", "aten::add", "aten::silu",
                                                                              "aten::rsqrt", "aten::pow", "aten::mean",
                                                                              "aten::neg", "aten::div", "aten::sub",
                                                                              "aten::cat", "silu_backward", "aten::exp",
                                                                              "aten::sum", "aten::where")),
    ("fused AdamW kernels", ("_foreach_", "_fused_adam")),
    ("copies and allocation", ("aten::copy_", "aten::to", "aten::_to_copy", "aten::empty", "aten::zeros",
                               "aten::fill_", "aten::clone", "aten::contiguous", "aten::index", "aten::gather",
                               "aten::scatter")),
)


def family_of(name: str) -> str:
    for family, keys in FAMILIES:
        if any(k in name for k in keys):
            return family
    return "other"


def write_profile(prof, path: Path, a) -> None:
    """Self CPU time per operator over the measured steps, the top 25 and the totals per family, as markdown
    (and the raw table beside it). The profiled process's wall time minus the operators' self time is what
    the Python around them costs (the loop, tokenisation, the env's checker)."""
    events = prof.key_averages()
    total_us = sum(e.self_cpu_time_total for e in events)
    by_family: dict[str, float] = {}
    for e in events:
        by_family[family_of(e.key)] = by_family.get(family_of(e.key), 0.0) + e.self_cpu_time_total
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:25]
    adamw_us = sum(e.cpu_time_total for e in events if e.key.startswith("Optimizer.step#"))
    lines = [f"# torch.profiler: lopd {a.pair}, {a.steps - a.warmup} measured step(s) after {a.warmup} warm-up",
             "", f"{a.tasks} prompts x {a.group} samples, {a.new_tokens} new tokens, {a.threads} threads, "
             f"memory budget {a.memory_budget or 'off'} GiB, AdamW {'fused' if a.fused else 'for-loop (torch default on CPU)'}. "
             f"Operators' self CPU time: {total_us / 1e6:.1f} s; AdamW's step with every kernel it runs: "
             f"{adamw_us / 1e6:.1f} s (its for-loop kernels count as elementwise below).",
             "", "| operator family | self CPU s | share |", "|---|---:|---:|"]
    for family, us in sorted(by_family.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {family} | {us / 1e6:.1f} | {100 * us / total_us:.1f}% |")
    lines += ["", "| operator | calls | self CPU s | share |", "|---|---:|---:|---:|"]
    for e in top:
        lines.append(f"| `{e.key}` | {e.count} | {e.self_cpu_time_total / 1e6:.2f} | {100 * e.self_cpu_time_total / total_us:.1f}% |")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    path.with_suffix(".txt").write_text(events.table(sort_by="self_cpu_time_total", row_limit=60))
    print(f"profile: {path}", file=sys.stderr)


def _versions(*names: str) -> dict:
    import importlib.metadata as md

    return {n: md.version(n) for n in names}


# ------------------------------------------------------------------------------------------------- TRL side


def run_trl(a) -> dict:
    if TRL_CLASS[a.pair] is None:
        raise SystemExit(f"TRL has no trainer for pair '{a.pair}' (LOPD is lopd's own method): "
                         f"run it with --system lopd")
    import torch

    torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM, PrinterCallback, ProgressCallback, TrainerCallback

    from datasets import Dataset
    from lopd.envs.toolworld import ToolWorld
    from lopd.session import tasks_for_step
    from lopd.models import load_tokenizer
    from lopd.prompts import encode_prompt

    t0 = time.perf_counter()
    folder = model_folder(a.model)
    per_step = a.tasks * a.group
    mb = a.micro_batch or per_step
    if per_step % mb:
        raise SystemExit(f"--micro-batch {mb} does not divide tasks x group = {per_step}")
    env = ToolWorld()
    train_tasks = env.tasks("train")
    ordered = [t for s in range(a.steps) for t in tasks_for_step(train_tasks, s, a.tasks, a.seed)]  # lopd's order
    tokenizer = load_tokenizer(folder)  # left padding, pad = EOS, as lopd's
    ids = tokenizer.apply_chat_template([t.messages for t in ordered[:a.tasks]], add_generation_prompt=True,
                                        tokenize=True, return_dict=True)["input_ids"]
    assert [list(x) for x in ids] == [encode_prompt(tokenizer, t.messages) for t in ordered[:a.tasks]], \
        "TRL's chat-template tokenisation differs from lopd's encode_prompt"

    def load():
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)

    model = load()
    timing = {"gen_s": 0.0, "score_s": 0.0, "tokens": 0, "calls": 0}
    eos = {tokenizer.eos_token_id} | set(_as_list(model.generation_config.eos_token_id))
    generate = model.generate

    expected = [sorted(tuple(encode_prompt(tokenizer, t.messages)) for t in ordered[s * a.tasks:(s + 1) * a.tasks]
                       for _ in range(a.group)) for s in range(a.steps)]

    def timed_generate(*args, **kwargs):
        prompt = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        mask = kwargs.get("attention_mask", torch.ones_like(prompt)).bool()
        step = timing["calls"]
        timing["calls"] += 1
        seen = sorted(tuple(row[m].tolist()) for row, m in zip(prompt, mask))
        assert seen == expected[step], f"TRL's step {step + 1} samples other prompts than lopd's"
        start = time.perf_counter()
        out = generate(*args, **kwargs)
        timing["gen_s"] += time.perf_counter() - start
        sequences = out if isinstance(out, torch.Tensor) else out.sequences
        completion = sequences[:, prompt.shape[1]:]
        is_eos = torch.isin(completion, torch.tensor(sorted(eos)))
        length = torch.where(is_eos.any(-1), is_eos.float().argmax(-1) + 1, completion.shape[1])
        timing["tokens"] += int(length.sum())
        return out

    model.generate = timed_generate

    def toolworld_reward(prompts, completions, task_key, **kwargs):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(env.score(ordered[k], text).reward) for k, text in zip(task_key, texts)]

    steps: list[dict] = []
    rewards: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.start, self.before = time.perf_counter(), dict(timing)

        def on_step_end(self, args, state, control, **kw):
            step = time.perf_counter() - self.start
            gen, score = timing["gen_s"] - self.before["gen_s"], timing["score_s"] - self.before["score_s"]
            steps.append({"step_s": step, "gen_s": gen, "score_s": score, "train_s": step - gen - score,
                          "tokens": timing["tokens"] - self.before["tokens"]})

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                rewards.append(logs["reward"])

    common = dict(
        output_dir=tempfile.mkdtemp(prefix=f"trl_compare_trl_{a.pair}_"), use_cpu=True, bf16=False, fp16=False,
        activation_checkpointing=False,  # TRL's default is on (`gradient_checkpointing`, its deprecated alias)
        max_steps=a.steps, per_device_train_batch_size=mb,
        gradient_accumulation_steps=per_step // mb, learning_rate=a.lr, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.99, max_grad_norm=1.0, optim="adamw_torch",
        seed=a.seed, data_seed=a.seed, logging_steps=1, report_to="none", save_strategy="no", eval_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0, remove_unused_columns=False, shuffle_dataset=False,
        max_completion_length=a.new_tokens, temperature=1.0, top_p=1.0, top_k=0,
        generation_kwargs={"min_new_tokens": a.new_tokens},  # exactly new_tokens tokens, as on lopd's side
    )
    if a.pair in ("grpo", "sdpo"):
        rows = [{"prompt": t.messages, "task_key": i} for i, t in enumerate(ordered)]  # the sampler repeats x group
    else:
        rows = [{"prompt": t.messages, "task_key": i} for i, t in enumerate(ordered) for _ in range(a.group)]
    dataset = Dataset.from_list(rows)

    if a.pair == "grpo":
        from trl import GRPOConfig, GRPOTrainer

        config = GRPOConfig(**common, num_generations=a.group, beta=0.0, epsilon=0.2, loss_type="dapo",
                            scale_rewards="group", num_iterations=1, mask_truncated_completions=False)
        trainer = GRPOTrainer(model=model, reward_funcs=[toolworld_reward], args=config, train_dataset=dataset,
                              processing_class=tokenizer)
    elif a.pair == "sdpo":
        from trl.experimental.sdpo import SDPOConfig, SDPOTrainer

        config = SDPOConfig(**common, num_generations=a.group, beta=0.0, distillation_mode="sampled_token",
                            distillation_alpha=1.0, distillation_weight=1.0, teacher_model_kind="ema",
                            teacher_update_rate=0.05, teacher_sync_steps=1, scale_rewards="group",
                            num_iterations=1, mask_truncated_completions=False)
        trainer = SDPOTrainer(model=model, reward_funcs=[toolworld_reward], args=config, train_dataset=dataset,
                              processing_class=tokenizer)
    else:  # opsd: on-policy distillation from a frozen teacher, the same checkpoint
        from trl import DistillationConfig, DistillationTrainer

        config = DistillationConfig(**common, beta=1.0)
        trainer = DistillationTrainer(model=model, teacher_model=load(), args=config, train_dataset=dataset,
                                      processing_class=tokenizer)
    calculate = getattr(trainer, "_calculate_rewards", None)
    if calculate is not None:
        def timed_rewards(*args, **kwargs):
            start = time.perf_counter()
            try:
                return calculate(*args, **kwargs)
            finally:
                timing["score_s"] += time.perf_counter() - start

        trainer._calculate_rewards = timed_rewards
    for cb in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(cb)
    trainer.add_callback(StepTimer())
    assert not trainer.model.is_activation_checkpointing and trainer.model.dtype == torch.float32
    setup_s, setup_rss = time.perf_counter() - t0, peak_rss_mib()
    trainer.train()
    for s, r in zip(steps, rewards):
        s["reward_mean"] = r
    import shutil
    import trl

    shutil.rmtree(config.output_dir, ignore_errors=True)
    return {"system": "trl", "pair": a.pair, "method": TRL_CLASS[a.pair], "steps": steps, "setup_s": setup_s,
            "setup_peak_rss_mib": setup_rss, "peak_rss_mib": peak_rss_mib(),
            "versions": {"trl": trl.__version__, "torch": torch.__version__,
                         **_versions("transformers", "accelerate", "datasets")}}


def _as_list(x) -> list:
    return [] if x is None else [x] if isinstance(x, int) else list(x)


def run_one(a) -> None:
    result = (run_lopd if a.system == "lopd" else run_trl)(a)
    result.update(summarise(result["steps"], a.warmup))
    result["settings"] = {k: getattr(a, k) for k in ("tasks", "group", "new_tokens", "steps", "warmup", "threads",
                                                     "lr", "micro_batch", "memory_budget", "seed", "lopd_set")}
    print(json.dumps(result), flush=True)


# ---------------------------------------------------------------------------------------------------- driver


def child(a, system: str, pair: str, log: Path) -> dict:
    python = TRL_PYTHON if system == "trl" else LOPD_PYTHON
    cmd = [str(python), str(Path(__file__).resolve()), "--system", system, "--pair", pair,
           *(f"--{k.replace('_', '-')}={getattr(a, k)}" for k in ("steps", "warmup", "tasks", "group", "new_tokens",
                                                                  "threads", "lr", "micro_batch", "memory_budget",
                                                                  "seed")),
           *(["--model", a.model] if a.model else []), *(f"--lopd-set={o}" for o in a.lopd_set)]
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "MKL_NUM_THREADS": str(a.threads),
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "TRANSFORMERS_VERBOSITY": "error"}
    start = time.perf_counter()
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=f, text=True, timeout=a.timeout)
        f.write(proc.stdout)
    wall = time.perf_counter() - start
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        raise SystemExit(f"{system}/{pair} failed (exit {proc.returncode}); see {log}")
    result = json.loads(lines[-1])
    result["process_wall_s"] = wall
    print(f"  {system:4s} {pair}: step {result['median_step_s']:.2f} s (gen {result.get('median_gen_s', 0):.2f}, "
          f"train {result.get('median_train_s', 0):.2f}), {result['median_tokens']:.0f} tokens/step, "
          f"peak RSS {result['peak_rss_mib']:.0f} MiB, process {wall:.0f} s", flush=True)
    return result


def median_of(results: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in results)


def drive(a) -> None:
    pairs = [p.strip() for p in a.pairs.split(",") if p.strip()]
    unknown = [p for p in pairs if p not in PAIRS]
    if unknown:
        raise SystemExit(f"--pairs: unknown {unknown}; choose from {', '.join(PAIRS)}")
    if not TRL_PYTHON.exists() and any(p != "lopd" for p in pairs):
        raise SystemExit(f"{TRL_PYTHON} is missing: run `bash scripts/setup_trl_venv.sh` first")
    logs = ROOT / "runs" / "trl_compare" / ("smoke" if a.smoke else "full")
    logs.mkdir(parents=True, exist_ok=True)
    out: dict = {"label": "smoke run (a harness check, not figures)" if a.smoke else "measurement",
                 "command": " ".join(["python", "benchmarks/trl_compare.py", *sys.argv[1:]]),
                 "settings": {k: getattr(a, k) for k in ("tasks", "group", "new_tokens", "steps", "warmup", "threads",
                                                         "lr", "micro_batch", "memory_budget", "seed", "repeats",
                                                         "lopd_set")},
                 "machine": _machine(), "started": time.strftime("%Y-%m-%d %H:%M:%S"), "pairs": {}}
    start = time.perf_counter()
    json_path = Path(a.out_json or (logs / "trl_compare.json" if a.smoke else ROOT / "benchmarks" / "trl_compare.json"))
    if json_path.is_file():  # resumable: pairs measured before with the same settings are kept, not rerun
        before = json.loads(json_path.read_text())
        if before.get("settings") == out["settings"]:
            out["pairs"] = {k: v for k, v in before.get("pairs", {}).items() if k in pairs}
            out["started"] = before.get("started", out["started"])
    for pair in pairs:
        if pair in out["pairs"]:
            print(f"pair {pair}: measured before ({json_path}), kept", flush=True)
            continue
        b_system, b_pair = ("lopd", "grpo") if pair == "lopd" else ("trl", pair)
        print(f"pair {pair}: lopd/{pair} vs {b_system}/{b_pair}, {a.repeats} x A B", flush=True)
        runs_a, runs_b = [], []
        for r in range(a.repeats):
            runs_a.append(child(a, "lopd", pair, logs / f"{pair}_lopd_{r}.log"))
            runs_b.append(child(a, b_system, b_pair, logs / f"{pair}_{b_system}-{b_pair}_{r}.log"))
        summary = {k: {"A": median_of(runs_a, f"median_{k}"), "B": median_of(runs_b, f"median_{k}")}
                   for k in ("step_s", "gen_s", "score_s", "train_s", "tokens")}
        summary["peak_rss_mib"] = {"A": median_of(runs_a, "peak_rss_mib"), "B": median_of(runs_b, "peak_rss_mib")}
        summary["step_ratio_B_over_A"] = summary["step_s"]["B"] / summary["step_s"]["A"]
        summary["rss_ratio_A_over_B"] = summary["peak_rss_mib"]["A"] / summary["peak_rss_mib"]["B"]
        summary["step_ratio_per_repeat"] = [b["median_step_s"] / x["median_step_s"] for x, b in zip(runs_a, runs_b)]
        out["pairs"][pair] = {"A": f"lopd {pair}", "B": TRL_CLASS[pair] if b_system == "trl" else "lopd grpo",
                              "summary": summary, "runs_A": runs_a, "runs_B": runs_b}
        out["wall_s"] = out.get("wall_s", 0.0) + time.perf_counter() - start
        start = time.perf_counter()
        json_path.write_text(json.dumps(out, indent=1) + "\n")  # after every pair: a stopped driver loses one pair
    render(a, json_path)


def render(a, json_path: Path) -> None:
    """The markdown block of a driver run's JSON: `smoke` or `results` in benchmarks/trl_compare.md."""
    out = json.loads(Path(json_path).read_text())
    md_path = Path(a.out_md or ROOT / "benchmarks" / "trl_compare.md")
    write_block(md_path, "smoke" if out["label"] != "measurement" else "results", markdown(out))
    print(f"wrote {json_path} and {md_path} ({out['wall_s'] / 60:.1f} min)")


def _machine() -> dict:
    import platform

    info = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}
    try:
        info["load_avg_at_start"] = os.getloadavg()
    except OSError:
        pass
    return info


def markdown(out: dict) -> str:
    """The results block of benchmarks/trl_compare.md for one driver run."""
    s, smoke = out["settings"], out["label"] != "measurement"
    load = ", ".join(f"{x:.2f}" for x in out["machine"].get("load_avg_at_start", ()))
    title = ("### Smoke run: a harness check, NOT figures" if smoke else "### Results")
    lines = [title, "",
             f"`{out['command']}`: {s['tasks']} prompts x {s['group']} samples per step, {s['new_tokens']} new "
             f"tokens forced, {s['warmup']} warm-up + {s['steps'] - s['warmup']} measured steps, {s['threads']} "
             f"thread(s), lr {s['lr']}, {s['repeats']} x A B per pair; started {out['started']} (load average at the "
             f"start {load}), {out['wall_s'] / 60:.1f} min in all. Seconds are medians (over a process's measured "
             f"steps, then over the repeats)."]
    if smoke:
        lines += ["", "These settings are far from the measured ones and the machine was busy with other work: the "
                  "numbers show only that every pair runs end to end on both sides and reports comparable work "
                  "(the same tokens per step). Do not quote them."]
    lines += ["", "| pair | lopd | TRL | lopd step s | TRL step s | **TRL / lopd step** | lopd gen / train s "
              "| TRL gen / train s | tokens/step lopd / TRL | lopd peak RSS MiB | TRL peak RSS MiB "
              "| **lopd / TRL RSS** |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lopd_pair = None
    for pair, p in out["pairs"].items():
        m = p["summary"]
        if pair == "lopd":
            lopd_pair = m
            continue
        lines.append(
            f"| {pair} | {p['A']} | `{p['B']}` | {m['step_s']['A']:.2f} | {m['step_s']['B']:.2f} | "
            f"**{m['step_ratio_B_over_A']:.2f}** | {m['gen_s']['A']:.2f} / {m['train_s']['A']:.2f} | "
            f"{m['gen_s']['B']:.2f} / {m['train_s']['B']:.2f} | {m['tokens']['A']:.0f} / {m['tokens']['B']:.0f} | "
            f"{m['peak_rss_mib']['A']:.0f} | {m['peak_rss_mib']['B']:.0f} | **{m['rss_ratio_A_over_B']:.2f}** |")
    lines += ["", "TRL / lopd step > 1: lopd takes less time per step (lopd's throughput is that many times TRL's). "
              "lopd / TRL RSS < 1: lopd's peak resident memory is lower. gen = generation (lopd `time/rollout`; "
              "TRL: time inside `model.generate`), train = step - generation - scoring."]
    if lopd_pair is not None:
        m = lopd_pair
        lines += ["", "| lopd only | LOPD step s | GRPO step s | **LOPD / GRPO step** | LOPD gen / train s | "
                  "GRPO gen / train s | tokens/step LOPD / GRPO | LOPD peak RSS MiB | GRPO peak RSS MiB | "
                  "**LOPD / GRPO RSS** |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
                  f"| lopd (`--config lopd`) vs lopd grpo | {m['step_s']['A']:.2f} | {m['step_s']['B']:.2f} | "
                  f"**{m['step_s']['A'] / m['step_s']['B']:.2f}** | {m['gen_s']['A']:.2f} / {m['train_s']['A']:.2f} | "
                  f"{m['gen_s']['B']:.2f} / {m['train_s']['B']:.2f} | "
                  f"{m['tokens']['A']:.0f} / {m['tokens']['B']:.0f} | "
                  f"{m['peak_rss_mib']['A']:.0f} | {m['peak_rss_mib']['B']:.0f} | "
                  f"**{m['rss_ratio_A_over_B']:.2f}** |", "",
                  "TRL has no LOPD: its row is LOPD's cost over lopd's own GRPO step on the same work "
                  "(A B A B as well)."]
    return "\n".join(lines) + "\n"


def write_block(path: Path, name: str, text: str) -> None:
    """Put `text` between `<!-- name:begin -->` and `<!-- name:end -->` in `path` (appended if absent),
    leaving the rest of the file (the method, the other block) as it is."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    old = path.read_text() if path.exists() else ""
    block = f"{begin}\n{text}{end}"
    if begin in old and end in old:
        new = old[:old.index(begin)] + block + old[old.index(end) + len(end):]
    else:
        new = old.rstrip("\n") + ("\n\n" if old else "") + block + "\n"
    path.write_text(new)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--system", choices=("lopd", "trl"), help="per-process mode (omit: the driver)")
    p.add_argument("--pair", choices=PAIRS, help="per-process mode: which pair")
    p.add_argument("--pairs", default=",".join(PAIRS), help="driver: comma-separated pairs")
    p.add_argument("--repeats", type=int, default=2, help="driver: A B repeats per pair (2 = A B A B)")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per process, warm-up included")
    p.add_argument("--warmup", type=int, default=1, help="first steps not measured")
    p.add_argument("--tasks", type=int, default=8, help="prompts per step")
    p.add_argument("--group", type=int, default=4, help="samples per prompt")
    p.add_argument("--new-tokens", type=int, default=48, help="new tokens per sample (forced on both sides)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (and OMP_NUM_THREADS in the driver)")
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate (both sides)")
    p.add_argument("--micro-batch", type=int, default=0, help="sequences per forward/backward (0: the whole step)")
    p.add_argument("--memory-budget", type=float, default=0.0,
                   help="lopd side: micro-batches planned under this many GiB (train.memory_budget_gib) instead of "
                        "the whole step in one (0: off, equal work with TRL)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="", help="HF model folder (default: lopd.models.smollm2_folder())")
    p.add_argument("--timeout", type=int, default=7200, help="driver: seconds per process")
    p.add_argument("--smoke", action="store_true", help="driver: tiny settings (2 x 2, 8 tokens, 1 + 1 steps, 1 "
                   "thread, 1 repeat) to check the harness: JSON and logs under runs/trl_compare/smoke/, the "
                   "`smoke` block of benchmarks/trl_compare.md")
    p.add_argument("--out-json", default="", help="driver: where the JSON goes")
    p.add_argument("--out-md", default="", help="driver: the markdown file whose `results` (or `smoke`) block is "
                   "rewritten (default benchmarks/trl_compare.md)")
    p.add_argument("--render", default="", help="only rewrite the markdown block from this driver JSON")
    p.add_argument("--lopd-set", action="append", default=[], metavar="KEY=VALUE",
                   help="lopd side of every pair (both processes of the `lopd` pair): one more config override, "
                        "e.g. train.skip_zero_loss_rows=true (repeatable)")
    p.add_argument("--fused", action="store_true", help="per-process lopd mode: optim.fused=true (AdamW's fused kernel)")
    p.add_argument("--profile", default="", help="per-process lopd mode: run the measured steps under torch.profiler "
                   "and write the operator table here (markdown; the raw table beside it as .txt)")
    a = p.parse_args(argv)
    if a.smoke:
        a.tasks, a.group, a.new_tokens, a.steps, a.warmup, a.threads, a.repeats = 2, 2, 8, 2, 1, 1, 1
    if a.steps <= a.warmup:
        p.error("--steps must be larger than --warmup")
    if a.render:
        render(a, Path(a.render))
    elif a.system:
        if not a.pair:
            p.error("--system needs --pair")
        run_one(a)
    else:
        drive(a)


if __name__ == "__main__":
    main()
