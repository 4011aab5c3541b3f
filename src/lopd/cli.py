"""The `lopd` command line.

    lopd train --config configs/grpo.yaml train.max_rollouts=256 model.lora.r=8
    lopd train runs/grpo_toolworld_seed0              resume a run from its directory
    lopd eval --run runs/grpo_toolworld_seed0         evaluate a run's latest checkpoint
    lopd eval --model tiny --split test transfer      evaluate any model
    lopd eval --model smollm2-135m --env acebench     ... on any env (bfcl, humaneval, your own)
    lopd bank runs/lopd_toolworld_seed0 --query "book a flight"   inspect an experience bank
    lopd inspect runs/lopd_toolworld_seed0            what its latent slots carry (inspect.png)
    lopd probe --out runs/probe                       what each context source gives the teacher, on val
    lopd pretrain-compressor --out runs/compressor    LOPD's compressor, pre-trained before RL
    lopd demo                                         the showcase on the bundled task and policy

Config keys are listed by `lopd train --help`. Errors in configs, data or model paths end in one
line that names the file, line or key.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path

from lopd.config import CONFIG_DIR, config_path, describe, load_config
from lopd.errors import ConfigError, LopdError
from lopd.quiet import silence_third_party
from lopd.schema import Config, EmbedderKind


def split_args(items: list[str]) -> tuple[str | None, list[str]]:
    """Positional arguments: at most one run directory, then key=value overrides."""
    run_dirs = [i for i in items if "=" not in i]
    if len(run_dirs) > 1:
        raise ConfigError(f"command line: expected at most one run directory, got {', '.join(run_dirs)} "
                          f"(overrides must look like key=value)")
    return (run_dirs[0] if run_dirs else None), [i for i in items if "=" in i]


def resolve_train_config(config: str | None, positional: list[str]) -> Config:
    """The config `lopd train` runs: a run directory's own (overrides on top), or --config's, which resumes
    the run it names if that exists. Checked before torch is imported: a config error takes a second."""
    from lopd.runs import RunDir, refuse_another_run, run_dir_for

    run_dir, overrides = split_args(positional)
    if run_dir is not None:
        run = RunDir(run_dir)
        if not run.exists():
            raise ConfigError(f"{run_dir}: not a run directory (no config.yaml); start one with --config")
        if config is not None:
            raise ConfigError("give either a run directory to resume or --config to start, not both")
    else:
        cfg = load_config(config_path(config), overrides)
        run = RunDir(run_dir_for(cfg))
        if not run.exists():
            return cfg
    # the run exists: it resumes under its own saved config, new overrides on top, if they may change on resume
    cfg = load_config(run.config_path, overrides + [f"run.dir={run.path}"])
    refuse_another_run(run, cfg)  # (again in session.build, for the API: here it fails before torch loads)
    return cfg


def cmd_train(args) -> int:
    cfg = resolve_train_config(args.config, args.args)
    from lopd.loop import train

    path = train(cfg)
    print(f"run directory: {path}\nreport: {path / 'report.md'}\ncurves: {path / 'curves.png'}")
    return 0


def cmd_eval(args) -> int:
    args.overrides += [s for s in args.split or [] if "=" in s]  # argparse's nargs="+" swallows them
    args.split = [s for s in args.split or [] if "=" not in s]
    if args.env:  # --env NAME or NAME:SPLIT (a plugin's path also has a colon: module:Class[:SPLIT])
        name, split = args.env, ""
        if args.env.count(":") == 2 or args.env.split(":")[0] in _bundled_envs():
            name, _, split = args.env.rpartition(":") if args.env.count(":") == 2 else args.env.partition(":")
        args.overrides.append(f"env.name={name}")
        if split:
            args.split = args.split or [split]
        elif not args.split and name != "toolworld":
            args.split = ["test"]
    if args.run:
        from lopd.runs import open_run  # no torch yet: a config error takes a second

        source, overrides = args.run, args.overrides
        opened = open_run(args.run, overrides)
        cfg, checkpoint = opened.cfg, opened.weights
    else:
        source = load_config(config_path(args.config), args.overrides + ([f"model.name={args.model}"] if args.model else []))
        overrides, cfg, checkpoint = [], source, "initial weights"
    from lopd.evaluation import EvalResult, category_table, evaluate

    # --json is written after every split and resumed from: splits it already holds under the same
    # settings are not evaluated again (a killed evaluation of a large benchmark keeps what it finished)
    import hashlib

    from lopd.config import to_dict

    settings = {k: v for k, v in to_dict(cfg).items() if k != "run"}
    header = {
        "model": cfg.model.name, "checkpoint": checkpoint, "env": cfg.env.name, "max_tasks": cfg.eval.max_tasks,
        "max_new_tokens": cfg.rollout.max_new_tokens, "temperature": cfg.eval.temperature,
        "config_sha256": hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()}
    wanted = list(args.split or cfg.env.eval_splits)
    done: dict[str, dict] = {}
    if args.json and Path(args.json).is_file():
        try:
            previous = json.loads(Path(args.json).read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{args.json}: not a JSON file of lopd eval ({e}); move it away or pass another --json")
        if {k: previous.get(k) for k in header} == header:
            done = dict(previous.get("splits", {}))
            if kept := [s for s in wanted if s in done]:
                print(f"{args.json}: {', '.join(kept)} already evaluated under these settings (kept)")
        else:
            print(f"{args.json}: written under other settings; evaluating every split again")

    def save(r) -> None:
        done[r.split] = r.summary()
        if args.json:  # written whole, then renamed: a kill never leaves half a file
            tmp = Path(f"{args.json}.tmp")
            tmp.write_text(json.dumps({**header, "splits": done}, indent=1))
            tmp.replace(args.json)

    todo = [s for s in wanted if s not in done]
    new = evaluate(source, splits=todo, overrides=overrides, on_result=save) if todo else []
    by_split = {**{s: EvalResult.from_summary(s, d) for s, d in done.items()}, **{r.split: r for r in new}}
    results = [by_split[s] for s in wanted]
    print(f"model: {cfg.model.name} ({checkpoint}); env: {cfg.env.name}; decoding: "
          f"{'greedy' if cfg.eval.temperature <= 0 else f'temperature {cfg.eval.temperature}'}")
    print(category_table(results))
    return 0


def _bundled_envs() -> list[str]:
    from lopd.envs import ENVS

    return list(ENVS)


def cmd_compare(args) -> int:
    from lopd.compare import cells as grid_cells
    from lopd.compare import load_grid, run_grid

    grid = load_grid(config_path(args.config), args.grid_overrides)
    from lopd.grid_report import write_grid_report

    if args.workers:
        grid.workers = args.workers
    cells = grid_cells(grid) if args.report_only else run_grid(grid)
    try:
        report = write_grid_report(grid, cells, command="lopd " + " ".join(sys.argv[1:]), merge=args.merge or [])
    except (ValueError, OSError) as e:
        raise ConfigError(f"--merge: {e}") from None
    print((report.parent / "report.md").read_text().split("## Success")[0])
    print(f"report: {report}\nfigures: {report.parent / 'curves.png'}")
    return 0


def cmd_bank(args) -> int:
    from collections import Counter

    import numpy as np

    from lopd.latent.embedder import build_embedder
    from lopd.latent.experience_bank import ExperienceBank

    from lopd.runs import RunDir

    run = RunDir(args.run_dir)
    folder = next((f for f in (run.bank_dir, run.skills_dir) if (f / "entries.jsonl").is_file()), None)
    if folder is None:
        raise ConfigError(f"{run.path}: no experience bank (bank/ or skills/ with entries.jsonl)")
    cfg = load_config(run.config_path) if run.exists() else load_config(None)
    minilm = cfg.algorithm.retrieval.embedder is EmbedderKind.minilm
    dim = 384 if minilm else _hidden_size(cfg.model.name)  # backbone keys: the model's hidden states
    bank = ExperienceBank(dim, folder, readonly=True)  # a look changes nothing, not even a torn tail
    if bank.disagreement:
        print(f"lopd: warning: the bank's files disagree ({bank.disagreement}); shown: the {len(bank.entries)} "
              f"entries both hold", file=sys.stderr)
    live = [bank.entries[i] for i in np.flatnonzero(bank.alive)]
    print(f"{folder}: {bank.size} live entries ({len(bank.entries)} written), key width {dim}")
    if live:
        steps = [e.step for e in live]
        print(f"successes {sum(e.success for e in live)} ({100 * sum(e.success for e in live) / len(live):.1f}%), "
              f"mean reward {np.mean([e.reward for e in live]):.3f}, steps {min(steps)}..{max(steps)}")
        print("by category: " + ", ".join(f"{c} {n}" for c, n in Counter(e.category or "-" for e in live).most_common(8)))
    if args.query:
        if not minilm:
            raise ConfigError("--query needs a bank keyed by the sentence embedder (algorithm.retrieval.embedder=minilm)")
        embedder = build_embedder("minilm", cfg.algorithm.retrieval.embedder_path)
        found = bank.search(embedder.encode([args.query]), args.top, successes_only=not args.all)
        print(f"\ntop {args.top} for {args.query!r}:")
        for i, sim in zip(found.index[0], found.similarity[0]):
            e = bank.entries[i]
            print(f"  {sim:.3f}  [{'ok' if e.success else 'fail'} r={e.reward:.2f} step {e.step}] {e.task_text}\n"
                  f"         -> {e.trajectory}")
    return 0


def _hidden_size(model: str) -> int:
    """The hidden size of `model.name`'s backbone, from its config.json (the width of backbone bank keys)."""
    from lopd.models import resolve_model

    config = json.loads((resolve_model(model) / "config.json").read_text())
    return int(config.get("hidden_size") or config["text_config"]["hidden_size"])


def cmd_inspect(args) -> int:
    from lopd.inspection import inspect_run

    png, md = inspect_run(args.run_dir, tasks=args.tasks, split=args.split, slots=args.slots)
    print(md.read_text().split("![inspect]")[0])
    print(f"picture: {png}\ntable: {md}")
    return 0


def cmd_probe(args) -> int:
    from dataclasses import fields

    args.overrides += [s for s in args.sources or [] if "=" in s]  # argparse's nargs="+" swallows them
    args.sources = [s for s in args.sources or [] if "=" not in s] or None
    cfg = load_config(config_path(args.config), args.overrides)
    from lopd.probe import ProbeSettings, run_probe

    settings = ProbeSettings(**{f.name: getattr(args, f.name) for f in fields(ProbeSettings)
                                if getattr(args, f.name, None) is not None})
    run_probe(cfg, settings, args.out)
    print(f"\n{(Path(args.out) / 'probe.md').read_text()}\ntable: {Path(args.out) / 'probe.md'}")
    return 0


def cmd_pretrain_compressor(args) -> int:
    from dataclasses import fields

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from lopd.latent.pretrain import PretrainSettings, pretrain_compressor

    cfg = load_config(config_path(args.config), args.overrides)
    settings = PretrainSettings(**{f.name: getattr(args, f.name) for f in fields(PretrainSettings)
                                   if getattr(args, f.name, None) is not None})
    shown = {"loss": "-", "ratio": "-"}
    with Progress(TextColumn("[bold]compressor"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("steps  KL {task.fields[loss]}  held-out KL ratio {task.fields[ratio]}"),
                  TimeElapsedColumn(), TimeRemainingColumn(), disable=not sys.stderr.isatty()) as bar:
        task = bar.add_task("", total=settings.steps, **shown)

        def progress(row: dict) -> None:
            shown["loss"] = f"{row['loss/cd']:.3f}"
            if "held_out_kl_ratio" in row:
                shown["ratio"] = f"{row['held_out_kl_ratio']:.2f}"
                if not sys.stderr.isatty():
                    print(f"step {row['step']}: KL {row['loss/cd']:.4f}, held-out KL ratio {row['held_out_kl_ratio']:.3f}",
                          flush=True)
            bar.update(task, completed=row["step"], **shown)

        meta = pretrain_compressor(cfg, settings, args.out, progress)
    out = Path(args.out) / "compressor.pt"
    print(f"held-out KL(text || slots) / KL(text || none): {meta['held_out_kl_ratio_at_start']:.3f} at the start, "
          f"{meta['held_out_kl_ratio']:.3f} after {meta['steps']} steps\ncompressor: {out}\n"
          f"use it: lopd train --config {args.config} algorithm.lopd.compressor_init={out}")
    return 0


def cmd_demo(args) -> int:
    import shutil

    from lopd.compare import load_grid, run_grid
    from lopd.grid_report import main_table, summarise, write_grid_report

    grid = load_grid(CONFIG_DIR / "compare_demo.yaml", args.grid_overrides + [f"out={args.out}"])
    if args.fresh and grid.root.exists():
        shutil.rmtree(grid.root)
    print(f"lopd demo: {', '.join(m.name for m in grid.methods)} on ToolWorld with the bundled tiny policy, "
          f"{grid.budget} rollouts each, {len(grid.seeds)} seed(s), {grid.workers} runs at a time -> {grid.root}")
    cells = run_grid(grid)
    report = write_grid_report(grid, cells, command="lopd " + " ".join(sys.argv[1:]))
    print("\nHeld-out success (%, greedy, student alone) after the budget; AUC = mean success over the budget:\n")
    print(main_table(summarise(grid, cells)))
    print(f"\nreport: {report}\nfigure: {report.parent / 'curves.png'}")
    return 0


HELP_WIDTH = 100  # no line of --help is wider
HELP_COLUMN = 42  # where each config key's meaning starts
EVAL_KEYS = ("model.", "env.", "eval.max_tasks", "eval.temperature", "eval.batch_size", "rollout.max_new_tokens",
             "rollout.max_turns", "train.device", "train.seed")  # what evaluation.evaluate_model reads


def key_lines(key: str, default: str, text: str) -> list[str]:
    """One config key of --help: `key=default`, then its meaning from HELP_COLUMN on, wrapped at HELP_WIDTH
    under a hanging indent (on the next line when `key=default` reaches into that column)."""
    item = textwrap.wrap(f"{key}={default}", HELP_WIDTH - 2, subsequent_indent="    ", break_on_hyphens=False)
    meaning = textwrap.wrap(text, HELP_WIDTH - HELP_COLUMN, break_on_hyphens=False) or [""]
    pad = " " * HELP_COLUMN
    if len(item) == 1 and len(item[0]) < HELP_COLUMN - 3:
        return [f"  {item[0]:<{HELP_COLUMN - 2}}{meaning[0]}"] + [pad + m for m in meaning[1:]]
    return [f"  {i}" for i in item] + [pad + m for m in meaning]


def keys_help(keep) -> str:
    """The config keys `keep` accepts, under a heading per section (run, model, model.lora, env, ...)."""
    lines, section = [], None
    for key, default, text in describe():
        if keep(key):
            if key.rpartition(".")[0] != section:
                section = key.rpartition(".")[0]
                lines += ["", f"{section}:"]
            lines += key_lines(key, default, text)
    return "\n".join(lines)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """argparse's layout at HELP_WIDTH columns; descriptions keep their lines (examples, key tables) and a
    line too long is wrapped under its own indentation."""

    def __init__(self, prog: str):
        super().__init__(prog, width=HELP_WIDTH, max_help_position=30)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n".join(textwrap.fill(line, width, initial_indent=indent,
                                        subsequent_indent=indent + " " * (len(line) - len(line.lstrip())))
                         if line.strip() else "" for line in text.splitlines())


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose help may end with config keys (`keys`: which to list), formatted only when the
    help is printed: listing them takes 0.1 s, which no other command should pay."""

    def __init__(self, *args, keys=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.keys = keys

    def format_help(self) -> str:
        if self.keys is not None:
            self.epilog, self.keys = self.epilog + "\n" + keys_help(self.keys), None
        return super().format_help()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lopd", description=__doc__, formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{train,eval,compare,bank,inspect,probe,pretrain-compressor,demo}",
                                parser_class=Parser)

    p = sub.add_parser("train", help="train a policy (or resume a run directory)", formatter_class=HelpFormatter,
                       description="Train a policy with the configured algorithm, or resume a run directory.",
                       epilog="config keys (key=default, meaning), by section:", keys=lambda key: True)
    p.add_argument("--config", help="YAML config file, or the name of a bundled one (grpo, lopd, demo, ...)")
    p.add_argument("args", nargs="*", metavar="RUN_DIR|key=value",
                   help="a run directory to resume, then key=value overrides of the config keys below")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("eval", help="evaluate a run's latest checkpoint or any model on held-out splits",
                       description="Evaluate the student alone (no context) on an env's splits; prints a "
                                   "per-category table of success (in %).", formatter_class=HelpFormatter,
                       epilog="config keys evaluation reads (key=default, meaning), by section:",
                       keys=lambda key: key.startswith(EVAL_KEYS))
    src = p.add_mutually_exclusive_group()
    src.add_argument("--run", help="run directory: its config and latest checkpoint")
    src.add_argument("--model", help="model name or folder (tiny, smollm2-135m, PATH)")
    p.add_argument("--config", help="YAML config (env, decoding) when not using --run")
    p.add_argument("--env", help="env to evaluate on, NAME or NAME:SPLIT (toolworld, acebench, bfcl:simple_python, "
                                 "humaneval, ...); default: the config's")
    p.add_argument("--split", nargs="+", help="splits to evaluate (default: env.eval_splits, or `test`)")
    p.add_argument("--json", help="also write the results to this JSON file, after each split; a split it "
                                  "already holds under the same config and checkpoint is not evaluated again")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="overrides of the config keys below")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("compare", formatter_class=HelpFormatter, help="run a grid of methods x seeds under one budget and write the report",
                       description="Run every (method, seed[, backbone, env]) of a grid file under one rollout budget, "
                                   "in parallel worker processes, then write report.md, report.json and figures. "
                                   "An interrupted grid continues where it stopped.")
    p.add_argument("--config", required=True, help="grid YAML file (see configs/compare_toolworld.yaml)")
    p.add_argument("--workers", type=int, default=0, help="parallel runs (default: the grid's `workers`)")
    p.add_argument("--report-only", action="store_true", help="only (re)write the report from existing runs")
    p.add_argument("--merge", action="append", metavar="REPORT_JSON",
                   help="also tabulate and plot the methods of this recorded report.json (same budget, seeds and "
                        "splits) whose runs are not on this machine; repeatable")
    p.add_argument("grid_overrides", nargs="*", metavar="key=value", help="top-level grid keys, e.g. seeds=[0,1]")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("bank", formatter_class=HelpFormatter, help="size, statistics and top entries of a run's experience bank",
                       description="Print the size and statistics of a run's experience bank (LOPD's bank/ or "
                                   "Skill-SD's skills/) and, with --query, its top entries for a request.")
    p.add_argument("run_dir", help="run directory")
    p.add_argument("--query", help="a request to retrieve for")
    p.add_argument("--top", type=int, default=5, help="entries to show (default 5)")
    p.add_argument("--all", action="store_true", help="include failed trajectories in the results")
    p.set_defaults(func=cmd_bank)

    p = sub.add_parser("inspect", formatter_class=HelpFormatter, help="what an LOPD run's latent slots carry: attention, nearest tokens, Delta",
                       description="For a few held-out tasks: the retrieved experiences, the composer's attention of "
                                   "each latent slot over their tokens, each slot's nearest vocabulary token, and Delta "
                                   "on successes/failures over training. Writes RUN_DIR/inspect.png and inspect.md.")
    p.add_argument("run_dir", help="an LOPD run directory")
    p.add_argument("--tasks", type=int, default=3, help="tasks to show (default 3)")
    p.add_argument("--split", help="split the tasks come from (default: the first of env.eval_splits)")
    p.add_argument("--slots", type=int, default=48, help="slots drawn per task (default 48)")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("probe", formatter_class=HelpFormatter,
                       help="how much privilege each context source gives a self-teacher, before any grid",
                       description="On a fixed bank (the untrained policy's rollouts on the train split) and the student's "
                                   "own trajectories on a held-out split: per context source, the teacher's gain on "
                                   "successes and failures, the privilege AUC, A x Delta, the context's shift, its "
                                   "tokens, and greedy success with the context (lopd/probe.py). Resumable.")
    p.add_argument("--out", required=True, help="folder for probe.md, probe.json and the cached bank")
    p.add_argument("--config", help="YAML config or bundled name for the model, env and decoding (default: lopd)",
                   default="lopd")
    p.add_argument("--sources", nargs="+", help="context sources (default: none, reference, every key x k, latent)")
    p.add_argument("--split", help="the held-out split (default: val)")
    p.add_argument("--val-tasks", dest="val_tasks", type=int, help="tasks of the split (default 100)")
    p.add_argument("--group", type=int, help="trajectories per task (default 8)")
    p.add_argument("--bank-rollouts", dest="bank_rollouts", type=int, help="rollouts in the bank (default 2048)")
    p.add_argument("--early-rollouts", dest="early_rollouts", type=int, help="the early bank's rollouts (default 176)")
    p.add_argument("--latent-steps", dest="latent_steps", type=int, help="compressor training steps (default 200)")
    p.add_argument("--compressor", help="a compressor.pt from `lopd pretrain-compressor`, for the latent:pretrained source")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.set_defaults(func=cmd_probe)

    p = sub.add_parser("pretrain-compressor", formatter_class=HelpFormatter,
                       help="train LOPD's compressor by context distillation before any RL (no env reward)",
                       description="Train a compressor of algorithm.lopd.latent_tokens slots to make the frozen teacher "
                                   "reading its slots match the teacher reading the text context (KL per token on the "
                                   "policy's own samples), on a corpus that costs no env reward: ToolWorld's sft-pool "
                                   "tools with same-tool calls as context, or your JSONL of {messages, context} rows "
                                   "(lopd/latent/pretrain.py). Resumable. Then: lopd train --config lopd_compressor "
                                   "algorithm.lopd.compressor_init=OUT/compressor.pt")
    p.add_argument("--out", required=True, help="folder for compressor.pt, pretrain.jsonl and the resumable state.pt")
    p.add_argument("--config", default="lopd_compressor",
                   help="YAML config or bundled name for the model, K and decoding (default: lopd_compressor)")
    p.add_argument("--steps", type=int, help="optimizer steps (default 300)")
    p.add_argument("--corpus", help="`toolworld` (default) or a .jsonl of {\"messages\": [...], \"context\": \"...\"} rows")
    p.add_argument("--lr", type=float, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--schedule", choices=["cosine", "constant"],
                   help="learning rate over the steps: cosine decay to a tenth (default) or constant")
    p.add_argument("--prompts-per-step", dest="prompts_per_step", type=int, help="corpus prompts per step (default 8)")
    p.add_argument("--group", type=int, help="completions sampled per prompt (default 4)")
    p.add_argument("--held-out", dest="held_out", type=int, help="corpus prompts held out for the KL ratio (default 32)")
    p.add_argument("--eval-every", dest="eval_every", type=int, help="steps between held-out measurements (default 50)")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.set_defaults(func=cmd_pretrain_compressor)

    p = sub.add_parser("demo", formatter_class=HelpFormatter, help="LOPD against GRPO and the self-distillation baselines on the bundled task",
                       description="The showcase: trains the bundled tiny policy on ToolWorld with GRPO, OPSD, SDPO, "
                                   "Skill-SD and LOPD under one rollout budget (configs/compare_demo.yaml), writes "
                                   "runs/demo (one run directory per method, report.md, report.json, curves.png) "
                                   "and prints the comparison table. Re-running resumes or just re-prints.")
    p.add_argument("--out", default="runs/demo", help="grid directory (default: runs/demo)")
    p.add_argument("--fresh", action="store_true", help="delete the grid directory first")
    p.add_argument("grid_overrides", nargs="*", metavar="key=value", help="grid keys, e.g. budget=512 seeds=[0,1]")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    silence_third_party()  # our own progress display is enough
    try:
        return args.func(args)
    except LopdError as e:
        print(f"lopd: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
