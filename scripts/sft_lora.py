"""A short supervised LoRA fine-tune of a pretrained chat model on ToolWorld's `sft` pool, saved as a model folder.

The recipe that made the bundled tiny policy (`scripts/train_tiny_policy.py`), applied to a real model with
LoRA: requests to tools of the `sft` pool (fresh names and conventions per example, never a tool of `train`,
`val`, `test` or `transfer`), half of them with a privileged context in the formats the algorithms write
(earlier calls, a reference answer, skills, feedback). The model learns the call format and to read a
context, not any task tool's hidden conventions, so RL still has something to learn. The adapter is merged
into the weights and the result saved as a Hugging Face folder that `model.name=FOLDER` loads (add
`model.lora.enabled=true` to train a fresh adapter on top in RL).

    .venv/bin/python scripts/sft_lora.py --model smollm2-135m --steps 40 --batch-size 8 --out runs/smollm2_sft
    lopd compare --config configs/compare_toolworld_smollm2.yaml     # model.name: runs/smollm2_sft120

Choices are read on `val` (greedy, with and without two same-tool examples as context), never on `test`.
Deterministic for a given seed and thread count.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch

from lopd.config import load_config
from lopd.envs.toolworld import ToolWorld, ToolWorldConfig, sft_examples
from lopd.models import load_policy
from lopd.prompts import context_examples, encode_prompt
from lopd.rollout import sample
from lopd.tokens import positions


def encode(tokenizer, messages, target: str, context) -> tuple[list[int], int]:
    """(prompt + target + end-of-turn ids, prompt length): the loss reads the target's tokens only."""
    prompt = encode_prompt(tokenizer, messages, context)
    return prompt + tokenizer(target + tokenizer.eos_token, add_special_tokens=False)["input_ids"], len(prompt)


def batches(examples, batch_size: int, rng: random.Random, pad_id: int):
    """Length-bucketed shuffled batches, left-padded so that every row's target ends the sequence:
    (ids [b, T], labels [b, T], mask [b, T]); labels -100 outside the targets."""
    order = sorted(range(len(examples)), key=lambda i: len(examples[i][0]) + rng.random())
    groups = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    rng.shuffle(groups)
    for g in groups:
        width = max(len(examples[i][0]) for i in g)
        ids = torch.full((len(g), width), pad_id, dtype=torch.long)
        labels = torch.full((len(g), width), -100, dtype=torch.long)
        mask = torch.zeros(len(g), width, dtype=torch.long)
        for row, i in enumerate(g):
            seq, n_prompt = examples[i]
            ids[row, width - len(seq):] = torch.tensor(seq)
            labels[row, width - len(seq) + n_prompt:] = torch.tensor(seq[n_prompt:])
            mask[row, width - len(seq):] = 1
        yield ids, labels, mask


def target_loss(model, ids, labels, mask):
    """Mean cross-entropy over the target tokens, the vocabulary's logits computed only at the last K
    positions (every target ends its row): a [b, K, V] block instead of [b, T, V]."""
    K = int((labels != -100).sum(1).max()) + 1
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), logits_to_keep=K).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, -K + 1:].flatten())


@torch.no_grad()
def val_success(model, tokenizer, env: ToolWorld, n: int, with_context: bool) -> float:
    """Greedy success on the first n `val` tasks; with_context: two earlier `train` calls of the same tool."""
    tasks = list(env.tasks("val"))[:n]
    contexts = [None] * len(tasks)
    if with_context:
        by_tool: dict[str, list] = {}
        for t in env.tasks("train"):
            by_tool.setdefault(t.category, []).append(t)
        contexts = [context_examples([(d.meta["request"], env.reference(d)) for d in by_tool[t.category][:2]])
                    for t in tasks]
    model.eval()
    prompts = [encode_prompt(tokenizer, t.messages, c) for t, c in zip(tasks, contexts)]
    out = sample(model, tokenizer, prompts, temperature=0.0, max_new_tokens=64, batch_size=50)
    return sum(env.score(t, text).success for t, text in zip(tasks, out.completions)) / len(tasks)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="a lopd model name or a Hugging Face folder")
    ap.add_argument("--out", required=True, help="the merged model folder to write")
    ap.add_argument("--examples", type=int, default=4000)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--r", type=int, default=16, help="LoRA rank (alpha = 2r, every projection)")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--eval-tasks", type=int, default=100, help="`val` tasks read at each evaluation")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    t0 = time.time()

    cfg = load_config(None, [f"model.name={args.model}", "model.dtype=float32", "model.lora.enabled=true",
                             f"model.lora.r={args.r}", f"model.lora.alpha={2 * args.r}"])
    model, tokenizer = load_policy(cfg.model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    examples = [encode(tokenizer, m, target, c) for m, target, c in sft_examples(args.examples, seed=args.seed)]
    env = ToolWorld(ToolWorldConfig(seed=0))
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=args.lr, weight_decay=0.0)
    warmup = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps))))
    log = [{"step": 0, "val": val_success(model, tokenizer, env, args.eval_tasks, False),
            "val+ctx": val_success(model, tokenizer, env, args.eval_tasks, True), "seconds": round(time.time() - t0)}]
    print(json.dumps(log[-1]), flush=True)
    step = 0
    while step < args.steps:
        for ids, labels, mask in batches(examples, args.batch_size, rng, pad):
            model.train()
            loss = target_loss(model, ids, labels, mask)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trained, 1.0)
            opt.step()
            sched.step()
            step += 1
            if step % 10 == 0:
                print(f"step {step} loss {loss.item():.4f} ({time.time() - t0:.0f}s)", flush=True)
            if step % args.eval_every == 0 or step == args.steps:
                log.append({"step": step, "loss": round(loss.item(), 4),
                            "val": val_success(model, tokenizer, env, args.eval_tasks, False),
                            "val+ctx": val_success(model, tokenizer, env, args.eval_tasks, True),
                            "seconds": round(time.time() - t0)})
                print(json.dumps(log[-1]), flush=True)
            if step >= args.steps:
                break

    out = Path(args.out)
    merged = model.merge_and_unload()
    merged.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "training_log.json").write_text(json.dumps({"args": vars(args), "eval": log}, indent=1))
    print(f"saved to {out} ({time.time() - t0:.0f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
