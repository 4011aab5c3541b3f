"""Build the bundled tiny policy: a byte-level BPE tokenizer and a small Llama, trained on ToolWorld.

What it learns: the call format, choosing the tool, copying values, the documented conventions, and
using a privileged context (earlier successful calls, a reference answer) when one is in the prompt.
What it cannot learn here: the hidden conventions of ToolWorld's train/test/transfer tools, because
the supervised examples come from a separate tool pool with conventions drawn at random per example.
That leaves RL room to learn and gives self-distillation a teacher that can read experience.

    python scripts/train_tiny_policy.py                    # writes src/lopd/assets/tiny/
    python scripts/train_tiny_policy.py --examples 2000 --steps 50 --out /tmp/tiny   # quick check
    python scripts/train_tiny_policy.py --p-context 0.8 --out /tmp/ctx   # a policy trained more on reading a context

Deterministic for a given seed and thread count. Takes about an hour on 2 CPU cores. Killed, it resumes:
every --checkpoint-every steps it writes `<out>/checkpoint/` (weights, optimiser, schedule, data order,
log), and the same command run again continues from there to the same weights an uninterrupted run gives.
Recipe choices read the periodic evaluation on `val` (greedy, 200 tasks: no context, two successful calls
of the task's tool, its reference answer); `test` and `transfer` are evaluated once, at the last step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from lopd.envs.toolworld import ToolWorld, ToolWorldConfig, sft_examples
from lopd.prompts import context_examples, context_reference, encode_prompt, prompt_text
from lopd.rollout import sample

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                  bos_token=None, unk_token=None, model_max_length=1024)
    out.chat_template = CHAT_TEMPLATE
    out.padding_side = "left"
    return out


def encode_example(tokenizer, messages, target: str, context) -> tuple[list[int], int]:
    prompt = encode_prompt(tokenizer, messages, context)
    completion = tokenizer(target + "<|im_end|>", add_special_tokens=False)["input_ids"]
    return prompt + completion, len(prompt)


def batches(examples, batch_size: int, rng: random.Random):
    """Length-bucketed shuffled batches: [(ids [b, T], labels [b, T], mask [b, T])]."""
    order = sorted(range(len(examples)), key=lambda i: len(examples[i][0]) + rng.random())
    groups = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    rng.shuffle(groups)
    for g in groups:
        width = -(-max(len(examples[i][0]) for i in g) // 32) * 32  # few distinct shapes: bf16 kernels cache per shape
        ids = torch.zeros(len(g), width, dtype=torch.long)
        labels = torch.full((len(g), width), -100, dtype=torch.long)
        mask = torch.zeros(len(g), width, dtype=torch.long)
        for row, i in enumerate(g):
            seq, n_prompt = examples[i]
            ids[row, :len(seq)] = torch.tensor(seq)
            labels[row, n_prompt:len(seq)] = torch.tensor(seq[n_prompt:])
            mask[row, :len(seq)] = 1
        yield ids, labels, mask


def success_rate(model, tokenizer, env: ToolWorld, split: str, n: int, with_context: bool | str = False,
                 show: int = 0) -> float:
    """Greedy success on the first n tasks of split; context False, True (two successful calls of the task's
    tool) or "reference" (its reference answer, OPSD's context)."""
    tasks = list(env.tasks(split))[:n]
    contexts = [None] * len(tasks)
    if with_context == "reference":
        contexts = [context_reference(env.reference(t)) for t in tasks]
    elif with_context:  # two successful calls of the same tool (train split for val/test, transfer itself otherwise)
        by_tool: dict[str, list] = {}
        for t in env.tasks("transfer" if split == "transfer" else "train"):
            by_tool.setdefault(t.category, []).append(t)
        contexts = [context_examples([(d.meta["request"], env.reference(d)) for d in by_tool[t.category]
                                      if d.id != t.id][:2]) for t in tasks]
    prompts = [encode_prompt(tokenizer, t.messages, c) for t, c in zip(tasks, contexts)]
    out = sample(model, tokenizer, prompts, temperature=0.0, max_new_tokens=72, batch_size=100)
    scores = [env.score(t, text) for t, text in zip(tasks, out.completions)]
    for t, text, sc in list(zip(tasks, out.completions, scores))[:show]:
        print(f"  [{split}{_suffix(with_context)}] {text!r} -> {sc.feedback} (want {env.reference(t)})")
    return sum(sc.success for sc in scores) / len(tasks)


RECIPE_BEFORE = {"p_context": 0.5}  # recipe flags added later: what a checkpoint written before them used
RECIPE = ("examples", "p_context", "steps", "batch_size", "lr", "vocab", "hidden", "layers", "heads", "seed", "bf16")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="src/lopd/assets/tiny")
    ap.add_argument("--examples", type=int, default=60000)
    ap.add_argument("--p-context", type=float, default=0.5,
                    help="share of the examples that carry a privileged context (what a self-teacher reads)")
    ap.add_argument("--steps", type=int, default=2500)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=192)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--checkpoint-every", type=int, default=250, help="steps between resumable checkpoints")
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True, help="bf16 autocast matmuls")
    args = ap.parse_args()
    out = Path(args.out)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    t0 = time.time()
    resume = load_checkpoint(out, args)

    raw = list(sft_examples(args.examples, seed=args.seed, p_context=args.p_context))
    if resume:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(out / "checkpoint")
    else:
        texts = [prompt_text(_Plain(), m, c) + target for m, target, c in raw[:5000]]
        tokenizer = build_tokenizer(texts, args.vocab)
    examples = [encode_example(tokenizer, m, target, c) for m, target, c in raw]
    lengths = [len(e[0]) for e in examples]
    print(f"{len(examples)} examples, tokens/example mean {sum(lengths) / len(lengths):.0f} max {max(lengths)}"
          f" ({time.time() - t0:.0f}s)", flush=True)

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=args.hidden, intermediate_size=int(args.hidden * 8 / 3) // 16 * 16,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.heads, max_position_embeddings=1024, tie_word_embeddings=True,
                         rope_theta=10000.0, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=None)
    model = LlamaForCausalLM(config)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, args.steps // 30)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps))))
    env = ToolWorld(ToolWorldConfig(seed=0))
    step, skip, log = 0, 0, {"eval": [], "loss": []}
    epoch_rng = rng.getstate()  # the data order of the epoch in progress: batches() draws it on its first batch
    if resume:
        model.load_state_dict(resume["model"])
        opt.load_state_dict(resume["optimizer"])
        sched.load_state_dict(resume["scheduler"])
        torch.set_rng_state(resume["torch_rng"])
        step, skip, log, epoch_rng = resume["step"], resume["batch_in_epoch"], resume["log"], resume["epoch_rng"]
        print(f"resumed from {out / 'checkpoint'} at step {step}", flush=True)
    else:
        tokenizer.save_pretrained(out / "checkpoint")
    while step < args.steps:
        rng.setstate(epoch_rng)
        for batch_in_epoch, (ids, labels, mask) in enumerate(batches(examples, args.batch_size, rng), start=1):
            if batch_in_epoch <= skip:
                continue
            model.train()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
                loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if step % 50 == 0:
                log["loss"].append({"step": step, "loss": round(loss.item(), 4)})
                print(f"step {step} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e} ({time.time() - t0:.0f}s)", flush=True)
            if step % args.eval_every == 0 or step == args.steps:
                contexts = (False, True, "reference")
                row = {"step": step, **{f"val{_suffix(c)}": success_rate(model, tokenizer, env, "val", 200, c, show=1)
                                        for c in contexts}}
                if step == args.steps:  # the held-out splits once, for the record; never for choosing
                    row |= {f"{s}{_suffix(c)}": success_rate(model, tokenizer, env, s, 200, c)
                            for s in ("test", "transfer") for c in contexts}
                log["eval"].append(row)
                print(json.dumps(row), flush=True)
                save(model, tokenizer, out, args, log)
            if step % args.checkpoint_every == 0 or step == args.steps:
                save_checkpoint(out, args, model, opt, sched, step, batch_in_epoch, epoch_rng, log)
            if step >= args.steps:
                break
        else:  # the epoch ran out: the next one draws its order from where this one left the generator
            epoch_rng, skip = rng.getstate(), 0

    print(f"saved to {args.out} ({time.time() - t0:.0f}s)")


def _suffix(context: bool | str) -> str:
    return {False: "", True: "+ctx", "reference": "+ref"}[context]


def load_checkpoint(out: Path, args) -> dict | None:
    """The checkpoint of an interrupted run with the same recipe, or None; a different recipe is refused."""
    path = out / "checkpoint" / "state.pt"
    if not path.exists():
        return None
    state = torch.load(path, weights_only=False)
    for key in RECIPE:
        written = state["args"].get(key, RECIPE_BEFORE.get(key))
        if written != getattr(args, key):
            raise SystemExit(f"{path}: written with --{key.replace('_', '-')} {written}, not "
                             f"{getattr(args, key)}; run with the same recipe to resume, or use another --out")
    return state


def save_checkpoint(out: Path, args, model, opt, sched, step, batch_in_epoch, epoch_rng, log) -> None:
    """Everything a resume needs, written atomically (a kill mid-write leaves the previous checkpoint)."""
    path = out / "checkpoint" / "state.pt"
    tmp = path.with_suffix(".tmp")
    torch.save({"args": vars(args), "model": model.state_dict(), "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(), "torch_rng": torch.get_rng_state(), "step": step,
                "batch_in_epoch": batch_in_epoch, "epoch_rng": epoch_rng, "log": log}, tmp)
    os.replace(tmp, path)


def save(model, tokenizer, out: Path, args, log) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "training_log.json").write_text(json.dumps({"args": vars(args), **log}, indent=1))


class _Plain:
    """Renders the chat template as text before a tokenizer exists (to train the tokenizer on)."""

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


if __name__ == "__main__":
    main()
