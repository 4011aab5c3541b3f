"""`lopd compare`: a grid of methods x seeds (x backbones x envs) under one rollout budget, then a report.

    lopd compare --config configs/compare_toolworld.yaml
    lopd compare --config configs/compare_toolworld.yaml --workers 2 seeds=[0,1]

The grid file:
    name: compare_toolworld            # runs go to runs/<name>/<method>/<backbone>/<env>/seed<k>
    budget: 2048                       # train.max_rollouts of every run (sampled trajectories)
    eval_every: 256                    # eval.every_rollouts of every run: same budget points for all
    seeds: [0, 1, 2]
    base: configs/demo.yaml            # the config every run starts from
    after: configs/humaneval_smollm2.yaml   # optional: applied after each method's config (model, env, sizes)
    overrides: [rollout.group_size=8]  # applied to every run
    methods:                           # name -> config file (+ optional overrides); `ablation: true` tags it
      grpo: {config: configs/grpo.yaml}
      lopd: {config: configs/lopd.yaml}
      lopd_no_margin: {config: configs/lopd_no_margin.yaml, ablation: true}
    backbones: [tiny]                  # optional: model.name values
    envs: [toolworld]                  # optional: env.name values
    reference: grpo                    # the method whose final success the "rollouts to reach" column uses

Every run is a normal run directory: an interrupted grid continues where it stopped (finished runs are
skipped, half-finished ones resume), and the same grid at a larger `budget` extends its finished runs
(with a constant learning rate, exactly the longer run); the report reads each run up to the grid's
budget. Runs execute in parallel worker processes, each with `threads_per_worker` torch threads (on 2
cores, 2 processes x 1 thread beat 1 x 2: see RESULTS.md).
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from lopd.config import load_config, to_yaml
from lopd.errors import ConfigError
from lopd.runs import RunDir  # (loads no torch: `lopd compare` checks the grid before torch is imported)


@dataclass
class Method:
    name: str
    config: str | None = None
    overrides: list[str] = field(default_factory=list)
    ablation: bool = False


@dataclass
class Grid:
    name: str
    budget: int
    eval_every: int
    seeds: list[int]
    methods: list[Method]
    base: str | None = None
    after: str | None = None
    overrides: list[str] = field(default_factory=list)
    backbones: list[str] = field(default_factory=list)
    envs: list[str] = field(default_factory=list)
    reference: str = "grpo"
    workers: int = 2
    threads_per_worker: int = 1
    out: str = ""
    source: str = ""

    @property
    def root(self) -> Path:
        return Path(self.out or f"runs/{self.name}")


@dataclass
class Cell:
    method: Method
    seed: int
    backbone: str | None
    env: str | None
    path: Path

    @property
    def label(self) -> str:
        parts = [self.method.name] + [p for p in (self.backbone, self.env) if p] + [f"seed{self.seed}"]
        return "/".join(parts)


GRID_KEYS = {"name", "budget", "eval_every", "seeds", "methods", "base", "after", "overrides", "backbones", "envs",
             "reference", "workers", "threads_per_worker", "out"}


def load_grid(path: str | Path, cli: list[str] | None = None) -> Grid:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such grid file")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({e})") from None
    for item in cli or []:  # top-level grid keys from the command line, e.g. seeds=[0,1] budget=512
        key, _, value = item.partition("=")
        raw[key] = yaml.safe_load(value)
    unknown = set(raw) - GRID_KEYS
    if unknown:
        raise ConfigError(f"{path}: unknown grid key(s) {', '.join(sorted(unknown))}; valid: {', '.join(sorted(GRID_KEYS))}")
    for key in ("name", "budget", "seeds", "methods"):
        if key not in raw:
            raise ConfigError(f"{path}: missing grid key '{key}'")
    if not isinstance(raw["methods"], dict) or not raw["methods"]:
        raise ConfigError(f"{path}: 'methods' must map method names to {{config: FILE, overrides: [...]}}")
    methods = []
    for name, spec in raw["methods"].items():
        spec = spec or {}
        bad = set(spec) - {"config", "overrides", "ablation"}
        if bad:
            raise ConfigError(f"{path}: method '{name}': unknown key(s) {', '.join(sorted(bad))}")
        methods.append(Method(name, spec.get("config"), list(spec.get("overrides", [])), bool(spec.get("ablation", False))))
    base_dir = path.parent
    resolve = lambda p: None if p is None else str(p if Path(p).is_file() else (base_dir / p if (base_dir / p).is_file() else p))  # noqa: E731
    for m in methods:
        m.config = resolve(m.config)
    grid = Grid(name=raw["name"], budget=int(raw["budget"]), eval_every=int(raw.get("eval_every", 0)),
                seeds=[int(s) for s in raw["seeds"]], methods=methods, base=resolve(raw.get("base")),
                after=resolve(raw.get("after")),
                overrides=list(raw.get("overrides", [])), backbones=list(raw.get("backbones", [])),
                envs=list(raw.get("envs", [])), reference=raw.get("reference", "grpo"),
                workers=int(raw.get("workers", 2)), threads_per_worker=int(raw.get("threads_per_worker", 1)),
                out=raw.get("out", ""), source=str(path))
    for cell in cells(grid):  # fail now on any bad config, not after an hour of training
        run_config(grid, cell)
    return grid


def cells(grid: Grid) -> list[Cell]:
    out = []
    for m, backbone, env, seed in itertools.product(grid.methods, grid.backbones or [None], grid.envs or [None], grid.seeds):
        parts = [m.name] + [p.replace("/", "_") for p in (backbone, env) if p] + [f"seed{seed}"]
        out.append(Cell(m, seed, backbone, env, grid.root.joinpath(*parts)))
    return out


def run_overrides(grid: Grid, cell: Cell) -> list[str]:
    extra = [f"train.max_rollouts={grid.budget}", f"train.seed={cell.seed}", f"run.dir={cell.path}",
             f"train.threads={grid.threads_per_worker}", "run.progress=false"]
    if grid.eval_every:
        extra.append(f"eval.every_rollouts={grid.eval_every}")
    if cell.backbone:
        extra.append(f"model.name={cell.backbone}")
    if cell.env:
        extra.append(f"env.name={cell.env}")
    return grid.overrides + cell.method.overrides + extra


def run_config(grid: Grid, cell: Cell):
    """The run's config: base file <- method file <- `after` file <- grid and method overrides <- the grid's
    fixed keys."""
    return load_config([grid.base, cell.method.config, grid.after], run_overrides(grid, cell))


def is_finished(grid: Grid, cell: Cell) -> bool:
    """Finished under this grid's budget: `train` writes `finished` (the budget it completed) last."""
    marker = RunDir(cell.path).finished_path
    return marker.is_file() and marker.read_text().strip() == str(grid.budget)


def stop_runs(procs: list[subprocess.Popen], grace_s: float = 300.0) -> None:
    """SIGTERM each run (it records `interrupted` and exits at once; its last checkpoint stays the resume
    point), then wait; a run still alive after `grace_s` is killed."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.time() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.time(), 0.1))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _launch(grid: Grid, cell: Cell) -> subprocess.Popen:
    cfg = run_config(grid, cell)
    cell.path.mkdir(parents=True, exist_ok=True)
    run = RunDir(cell.path)
    run.grid_config_path.write_text(to_yaml(cfg))
    env = {**os.environ, "OMP_NUM_THREADS": str(grid.threads_per_worker), "TOKENIZERS_PARALLELISM": "false"}
    log = open(run.train_log, "a")
    args = [sys.executable, "-m", "lopd.cli", "train"]
    # an existing run resumes under its own config, to this grid's budget: a larger one extends a finished run
    args += [str(cell.path), f"train.max_rollouts={grid.budget}"] if run.exists() else ["--config", str(run.grid_config_path)]
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)


def run_grid(grid: Grid, quiet: bool = False) -> list[Cell]:
    """Run every unfinished cell, `grid.workers` at a time; returns the cells. Raises if any run failed."""
    from rich.console import Console
    from rich.live import Live
    from rich.table import Table

    from lopd.run_io import terminated_as_interrupt

    all_cells = cells(grid)
    todo = [c for c in all_cells if not is_finished(grid, c)]
    console = Console(quiet=quiet)
    console.print(f"[bold]lopd compare[/bold] {grid.name}: {len(all_cells)} runs "
                  f"({len(all_cells) - len(todo)} already finished), {grid.workers} at a time -> {grid.root}")
    running: dict[str, tuple[Cell, subprocess.Popen, float]] = {}
    failed: list[Cell] = []
    queue = list(todo)

    def table() -> Table:
        t = Table(show_header=True, header_style="bold")
        for col in ("run", "rollouts", "held-out success", "elapsed"):
            t.add_column(col)
        for label, (cell, _, start) in running.items():
            rows = RunDir(cell.path).read_metrics()
            last = rows[-1] if rows else {}
            evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
            succ = " ".join(f"{k.split('/')[1]} {100 * v:.0f}%" for k, v in (evals[-1] if evals else {}).items()
                            if k.startswith("eval/") and k.endswith("/success"))
            t.add_row(label, f"{last.get('rollouts', 0)}/{grid.budget}", succ or "-", f"{time.time() - start:.0f}s")
        t.caption = f"{len(all_cells) - len(queue) - len(running)} of {len(all_cells)} done"
        return t

    try:
        with terminated_as_interrupt(), Live(table(), console=console, refresh_per_second=1, transient=True) as live:
            while queue or running:
                while queue and len(running) < grid.workers:
                    cell = queue.pop(0)
                    running[cell.label] = (cell, _launch(grid, cell), time.time())
                time.sleep(1.0)
                for label, (cell, proc, start) in list(running.items()):
                    if proc.poll() is not None:
                        del running[label]
                        status = "done" if proc.returncode == 0 else f"FAILED (exit {proc.returncode}, see {RunDir(cell.path).train_log})"
                        console.print(f"{label}: {status} in {time.time() - start:.0f}s")
                        if proc.returncode != 0:
                            failed.append(cell)
                live.update(table())
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: every running run stops at its own pace and records it
        stop_runs([proc for _, proc, _ in running.values()])
        console.print(f"interrupted: {len(running)} run(s) stopped, each resumes from its last checkpoint; "
                      "run the same command to continue")
        raise
    if failed:
        raise RuntimeError(f"{len(failed)} run(s) failed: " + ", ".join(str(RunDir(c.path).train_log) for c in failed))
    return all_cells
