"""The run directory: everything a run writes, everything needed to resume it, and nothing a crash can lose.

    runs/NAME/
      config.yaml            the resolved config (what actually ran)
      metrics.jsonl          one JSON object per training step and per evaluation
      tb/                    TensorBoard events (x axis: rollouts)
      checkpoints/step_N/    model/ (weights or adapter), optimizer.pt, state.pt, metrics.jsonl (the rows up to
                             and including step N), manifest.json (every file's size and sha256)
      samples/SPLIT_stepN.jsonl  every evaluated completion with its verdict, per evaluation
      bank/, skills/         the algorithm's own files (LOPD's experiences, Skill-SD's skills)
      status.json            how the last process ended (running / finished / crashed: why / interrupted)
      resumes.log            one line per resume: when, from which checkpoint, how the previous process ended
      lock                   held (flock) by the process that trains the run; a second one is refused
      report.md, curves.png  written at the end of training
      finished               written last, when the whole budget is trained (its text: the budget)
      inspect.png, inspect.md  `lopd inspect` (LOPD runs)
      train.log, grid_config.yaml  a run of a `lopd compare` grid: its output and the resolved grid entry

Every path inside a run directory is a property of `RunDir`: no other module joins a run's path with a name.

Crash consistency. A checkpoint is written under `.tmp_step_N`, with the metrics rows so far and a manifest
of its files' checksums, then the step's row is appended to metrics.jsonl, then the folder is renamed
(atomically) to `step_N`: whatever instant a process dies at, either step N's checkpoint is complete and its
row is in it, or neither exists and step N is redone. On resume the newest checkpoint whose manifest
verifies is used (a corrupt one is skipped with one warning line naming it), metrics.jsonl is rewritten
from that checkpoint's rows (torn, garbage or non-UTF-8 lines are reported and replaced, nothing is lost),
and what the lost steps wrote (later samples, TensorBoard events; the algorithm drops its own) is removed,
so the resumed run equals an uninterrupted one bit for bit. With no checkpoint, everything is removed.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from lopd.errors import ConfigError, LopdError
from lopd.seeding import rng_state, set_rng_state

CHECKPOINT_PREFIX = "step_"
MANIFEST = "manifest.json"


class RunInUse(LopdError):
    """Another process holds the run directory's lock."""


def warn(message: str) -> None:
    print(f"lopd: warning: {message}", file=sys.stderr, flush=True)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_error(e: BaseException, where: Path) -> LopdError | None:
    """A one-line LopdError for a failed write that is really a full or read-only disk (torch and safetensors
    report those as 'basic_ios::clear: iostream error' or 'unexpected pos'); None if it is something else."""
    code = getattr(e, "errno", None)
    if code == errno.EROFS or code == errno.EACCES:
        return LopdError(f"{where}: cannot write ({os.strerror(code).lower()})")
    try:
        free = shutil.disk_usage(where if where.exists() else where.parent).free
    except OSError:
        free = None
    if code in (errno.ENOSPC, errno.EDQUOT) or (free is not None and free < 64 * 2**20):
        shown = f" ({free / 2**20:.0f} MB free)" if free is not None else ""
        return LopdError(f"no space left on device while writing {where}{shown}: free some space, then resume "
                         f"the run with `lopd train RUN_DIR`")
    return None


@contextmanager
def one_line_write_errors(where: Path) -> Iterator[None]:
    """Inside the block, an OSError that is a full or read-only disk becomes `write_error`'s one line, naming
    the file the OS names (else `where`); any other error passes unchanged."""
    try:
        yield
    except OSError as e:
        raise (write_error(e, Path(e.filename) if e.filename else where) or e) from None


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class PendingCheckpoint:
    """A checkpoint written under its temporary name: `commit()` makes it the run's newest checkpoint."""

    def __init__(self, run: "RunDir", tmp: Path, final: Path, keep: int):
        self.run, self.tmp, self.final, self.keep = run, tmp, final, keep

    def finish(self, rows: list[dict]) -> None:
        """Add the metrics rows so far (this step's included) and the manifest of every file."""
        try:
            with open(self.tmp / "metrics.jsonl", "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
            files = {str(p.relative_to(self.tmp)): p for p in sorted(self.tmp.rglob("*")) if p.is_file()}
            for p in files.values():
                with open(p, "rb+") as f:
                    os.fsync(f.fileno())
            manifest = {"step": _step_of(self.final),
                        "files": {n: {"size": p.stat().st_size, "sha256": sha256(p)} for n, p in files.items()}}
            (self.tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
            fsync_dir(self.tmp)
        except Exception as e:
            self.abandon()
            raise write_error(e, self.tmp) or e

    def commit(self) -> Path:
        from lopd import failpoints

        failpoints.reached("checkpoint.rename")
        with one_line_write_errors(self.final):
            shutil.rmtree(self.final, ignore_errors=True)
            os.replace(self.tmp, self.final)
            fsync_dir(self.final.parent)
        failpoints.reached("checkpoint.after_rename")
        done = sorted(self.run.checkpoint_folders(), key=_step_of)
        for old in done[:-self.keep] if self.keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
        return self.final

    def abandon(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def _step_of(p: Path) -> int:
    return int(p.name[len(CHECKPOINT_PREFIX):])


class RunDir:
    def __init__(self, path: str | Path, writer: bool = True):
        """`writer`: this process writes the run (False on data-parallel ranks other than 0, which read it)."""
        self.path = Path(path)
        self.checkpoints = self.path / "checkpoints"
        self.writer = writer
        self._lock_fd: int | None = None
        self._lock_record: str | None = None  # the lock file's text when this process took it (`acquire`)

    config_path = property(lambda self: self.path / "config.yaml")
    metrics_path = property(lambda self: self.path / "metrics.jsonl")
    status_path = property(lambda self: self.path / "status.json")
    resumes_path = property(lambda self: self.path / "resumes.log")
    lock_path = property(lambda self: self.path / "lock")
    finished_path = property(lambda self: self.path / "finished")
    tensorboard_dir = property(lambda self: self.path / "tb")
    samples_dir = property(lambda self: self.path / "samples")
    bank_dir = property(lambda self: self.path / "bank")
    skills_dir = property(lambda self: self.path / "skills")
    report_path = property(lambda self: self.path / "report.md")
    curves_path = property(lambda self: self.path / "curves.png")
    inspect_png = property(lambda self: self.path / "inspect.png")
    inspect_md = property(lambda self: self.path / "inspect.md")
    train_log = property(lambda self: self.path / "train.log")
    grid_config_path = property(lambda self: self.path / "grid_config.yaml")

    def samples_path(self, split: str, step: int) -> Path:
        """The completions of the evaluation of `split` at `step`."""
        return self.samples_dir / f"{split}_step{step:06d}.jsonl"

    def finished(self) -> bool:
        return self.finished_path.is_file()

    def mark_finished(self, budget: int) -> None:
        """Written last: the whole budget is trained."""
        with one_line_write_errors(self.finished_path):
            self.finished_path.write_text(str(budget))

    def write_config(self, text: str) -> None:
        """config.yaml, replaced atomically (a failed write leaves the previous one)."""
        tmp = self.config_path.with_suffix(".tmp")
        with one_line_write_errors(self.config_path):
            tmp.write_text(text)
            os.replace(tmp, self.config_path)

    def write_samples(self, split: str, step: int, samples: list[dict]) -> None:
        """The evaluated completions of `split` at `step`, one JSON object per line."""
        with one_line_write_errors(self.samples_path(split, step)):
            self.samples_dir.mkdir(exist_ok=True)
            with open(self.samples_path(split, step), "w") as f:
                f.writelines(json.dumps(s) + "\n" for s in samples)

    def exists(self) -> bool:
        return self.config_path.is_file()

    # ------------------------------------------------------------------ ownership

    def acquire(self) -> None:
        """Hold the run's lock for this process's life (an OS lock: a killed process's lock is released by
        the kernel, so it never blocks). A second trainer fails at once, naming the holder."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise write_error(e, self.path) or LopdError(f"{self.path}: cannot create the run directory ({e})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip().split("\n")[0] or "another process"
            os.close(fd)
            raise RunInUse(f"{self.path} is in use by {holder}; wait for it to finish or stop it first") from None
        self._lock_record = os.pread(fd, 4096, 0).decode(errors="replace")  # how its last holder ended (`end`)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {os.uname().nodename}, since {time.strftime('%Y-%m-%d %H:%M:%S')}"
                  .encode(), 0)
        self._lock_fd = fd

    def release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            self._lock_fd = None

    def begin(self, checkpoint: Path | None, resuming: bool) -> tuple[str, str] | None:
        """Record a start: a resumed run gets one line in resumes.log saying from where and how the previous
        process ended (both returned: ("step_000004", "interrupted (SIGTERM)")); status.json says this one
        is running."""
        previous, resumed = self.read_status(), None
        if resuming:
            previous = previous or {"state": "unknown (no status.json: written by an older lopd)"}
            resumed = (checkpoint.name if checkpoint is not None else "the start (no checkpoint)", how_it_ended(previous))
            with one_line_write_errors(self.resumes_path), open(self.resumes_path, "a") as f:
                f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} resumed from {resumed[0]}; previous process: "
                        f"{resumed[1]}\n")
        with one_line_write_errors(self.status_path):
            self.write_status({"state": "running", "pid": os.getpid(), "since": time.time()})
        return resumed

    def end(self, state: str, detail: str = "") -> bool:
        """Record how this process ends in status.json. Never raises: when the run directory can no longer be
        written (a full or read-only disk, the error this process is ending with), the record goes into the
        lock file, whose descriptor this process holds open, and the next start reads it from there
        (`read_status`). False if status.json could not be written."""
        status = {"state": state, "pid": os.getpid(), "at": time.time(), "detail": detail}
        try:
            self.write_status(status)
            return True
        except OSError:
            if self._lock_fd is not None:
                try:
                    os.pwrite(self._lock_fd, f"\nended {json.dumps(status)}\n".encode(), os.fstat(self._lock_fd).st_size)
                except OSError:
                    pass
            return False

    def read_status(self) -> dict | None:
        """status.json, or, where it still says "running" for a process whose end could only be recorded in the
        lock file (`end`), that record."""
        try:
            status = json.loads(self.status_path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {"state": "unknown (status.json unreadable)"}
        if not isinstance(status, dict):
            return {"state": "unknown (status.json is not an object)"}
        if status.get("state") == "running":
            ended = self._ended_in_lock()
            if ended is not None and ended.get("pid") == status.get("pid"):
                return ended
        return status

    def _ended_in_lock(self) -> dict | None:
        """The "ended {...}" record the lock file's last holder left (as it was when this process took the lock)."""
        text = self._lock_record
        if text is None:
            try:
                text = self.lock_path.read_text(errors="replace")
            except OSError:
                return None
        for line in reversed(text.splitlines()):
            if line.startswith("ended "):
                try:
                    record = json.loads(line[len("ended "):])
                except ValueError:
                    return None
                return record if isinstance(record, dict) else None
        return None

    def write_status(self, status: dict) -> None:
        tmp = self.status_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(status))
        os.replace(tmp, self.status_path)

    # ------------------------------------------------------------------ metrics

    def log(self, row: dict[str, Any]) -> None:
        from lopd import failpoints

        line = json.dumps(row) + "\n"
        try:
            with self.metrics_path.open("a") as f:
                failpoints.reached("metrics.write", lambda: (f.write(line[: len(line) // 2]), f.flush()))
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise write_error(e, self.metrics_path) or e

    def read_metrics(self, warn_about: bool = False) -> list[dict]:
        """Every complete row; a torn, non-UTF-8 or non-object line is skipped (named, if `warn_about`)."""
        if not self.metrics_path.is_file():
            return []
        rows = []
        for lineno, raw in enumerate(self.metrics_path.read_bytes().split(b"\n"), 1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, ValueError):
                row = None
            if isinstance(row, dict) and "step" in row:
                rows.append(row)
            elif warn_about:
                warn(f"{self.metrics_path}:{lineno}: not a metrics row ({raw[:40]!r}...); skipped")
        return rows

    def restore_metrics(self, rows: list[dict]) -> None:
        """metrics.jsonl := `rows` (the checkpoint's own), atomically; damaged lines are reported first."""
        if self.metrics_path.is_file():
            self.read_metrics(warn_about=True)
        tmp = self.metrics_path.with_suffix(".tmp")
        with one_line_write_errors(self.metrics_path):
            with open(tmp, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.metrics_path)

    # -------------------------------------------------------------- checkpoints

    def checkpoint_folders(self) -> list[Path]:
        if not self.checkpoints.is_dir():
            return []
        return [p for p in self.checkpoints.iterdir() if re.fullmatch(rf"{CHECKPOINT_PREFIX}\d+", p.name) and p.is_dir()]

    def verify(self, folder: Path) -> str | None:
        """Why `folder` is not a usable checkpoint, or None. Checkpoints without a manifest (written before
        manifests existed) are accepted if their state.pt exists."""
        manifest = folder / MANIFEST
        if not manifest.is_file():
            return None if (folder / "state.pt").is_file() else "no manifest.json and no state.pt"
        try:
            files = json.loads(manifest.read_text())["files"]
        except (ValueError, KeyError, OSError) as e:
            return f"unreadable manifest ({e})"
        for name, want in files.items():
            path = folder / name
            if not path.is_file():
                return f"{name} is missing"
            if path.stat().st_size != want["size"]:
                return f"{name} has {path.stat().st_size} bytes, the manifest says {want['size']}"
            if sha256(path) != want["sha256"]:
                return f"{name} does not match its checksum"
        return None

    def latest_checkpoint(self, warn_about: bool = False) -> Path | None:
        """The newest checkpoint that verifies; each newer one that does not is skipped (with a warning)."""
        for folder in sorted(self.checkpoint_folders(), key=_step_of, reverse=True):
            why = self.verify(folder)
            if why is None:
                return folder
            if warn_about:
                warn(f"checkpoint {folder} is damaged ({why}); using the previous one")
        return None

    def remove_stale(self) -> None:
        """Temporary folders of checkpoints that were being written when a process died."""
        if self.checkpoints.is_dir():
            for p in self.checkpoints.glob(f".tmp_{CHECKPOINT_PREFIX}*"):
                shutil.rmtree(p, ignore_errors=True)

    def remove_after(self, step: int, rollouts: int) -> None:
        """What steps after `step` wrote outside the checkpoints: their samples and TensorBoard events
        (with no checkpoint, `step` is 0 and the whole tb/ goes)."""
        for f in self.samples_dir.glob("*_step*.jsonl"):
            m = re.search(r"_step(\d+)\.jsonl$", f.name)
            if m and int(m.group(1)) > step:
                f.unlink()
        if step == 0:
            shutil.rmtree(self.tensorboard_dir, ignore_errors=True)

    def save_checkpoint(self, step: int, model, optimizer, state: dict, keep: int = 2,
                        gathered: dict | None = None) -> PendingCheckpoint:
        """Write step `step`'s weights, optimizer and state under the checkpoint's temporary name; the
        result's `finish(rows)` adds the metrics rows and the manifest, and `commit()` (once the step's row is
        in metrics.jsonl) renames it into place. `gathered`: a sharded run's full model and optimizer state
        (`fsdp.checkpoint_state`), written instead of the (sharded) model's and optimizer's own."""
        from lopd import failpoints
        from lopd.models import save_weights

        final = self.checkpoints / f"{CHECKPOINT_PREFIX}{step:06d}"
        tmp = self.checkpoints / f".tmp_{CHECKPOINT_PREFIX}{step:06d}"
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            save_weights(model, tmp / "model", gathered["model"] if gathered else None)
            failpoints.reached("checkpoint.write")
            _save(gathered["optimizer"] if gathered else optimizer.state_dict(), tmp / "optimizer.pt")
            _save({**state, "rng": rng_state()}, tmp / "state.pt")
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise write_error(e, tmp) or e
        return PendingCheckpoint(self, tmp, final, keep)

    def checkpointed_algorithm_state(self) -> dict | None:
        """The algorithm's state in the newest checkpoint that verifies (what a resume will restore); None
        without a checkpoint. Read by an algorithm opening its files before the resume (the bank's count)."""
        import torch

        folder = self.latest_checkpoint()
        return None if folder is None else torch.load(folder / "state.pt", weights_only=False).get("algorithm", {})

    def load_checkpoint(self, folder: Path, model, optimizer) -> dict:
        from lopd.models import load_weights

        from lopd.fsdp import is_sharded, load_optimizer_state

        load_weights(model, folder / "model")
        import torch

        saved = torch.load(folder / "optimizer.pt", weights_only=False)
        load_optimizer_state(optimizer, saved) if is_sharded(model) else optimizer.load_state_dict(saved)
        state = torch.load(folder / "state.pt", weights_only=False)
        set_rng_state(state.pop("rng"))
        rows = folder / "metrics.jsonl"
        state["metrics"] = RunDir(folder).read_metrics() if rows.is_file() else None
        return state


def _save(obj: Any, path: Path) -> None:
    import torch

    with open(path, "wb") as f:  # a Python file object: a full disk raises OSError(ENOSPC), not an iostream error
        torch.save(obj, f)


def how_it_ended(status: dict) -> str:
    state = status.get("state")
    if state == "running":
        pid = status.get("pid")
        alive = False
        if pid:
            try:
                os.kill(pid, 0)
                alive = True
            except OSError:
                pass
        return (f"pid {pid} was still recorded as running" + (" (and is alive)" if alive else
                " and left no exit record: killed (SIGKILL, out of memory, power loss)"))
    if state == "crashed":
        return f"crashed: {status.get('detail', '')}"
    if state == "interrupted":
        return f"interrupted ({status.get('detail', '')})"
    if state == "finished":
        return "finished (the run is being extended)"
    return f"unknown ({status})"


# ------------------------------------------------------------------------------ naming and resuming a run


def env_label(name: str) -> str:
    """The env in a run directory's name: a bundled name as is, `pkg.module:Class` as `module_Class`,
    `path/file.py:Class` as `file_Class` (the same from any working directory), a class from a script's
    `__main__` as `Class`."""
    module, _, attribute = name.rpartition(":")
    if not module:
        return name
    if module == "__main__":
        label = attribute
    elif module.endswith(".py"):
        label = f"{Path(module).stem}_{attribute}"
    else:
        label = f"{module.rpartition('.')[2]}_{attribute}"
    return re.sub(r"[^A-Za-z0-9_-]+", "_", label.replace("<locals>", "")).strip("_")


def run_dir_for(cfg) -> Path:
    """`run.dir`, or the default name: runs/<algorithm>_<env>_seed<seed> (`env_label`)."""
    return Path(cfg.run.dir or f"runs/{cfg.algorithm.name}_{env_label(cfg.env.name)}_seed{cfg.train.seed}")


# What may differ between a run's config.yaml and the config that resumes (or extends) it: how long it runs,
# what and how it evaluates, logs and checkpoints, where it runs and how it plans its memory. Anything else
# (the model, the algorithm and every shape, the env and its tasks, sampling, the optimizer) would make the
# resumed run another run, or fail to load its checkpoint, and is refused. A key ending in "." is a section.
RESUMABLE = ("train.max_rollouts", "train.max_bad_steps", "train.flat_reward_steps", "eval.", "env.eval_splits",
             "run.", "train.device", "train.threads", "train.fsdp", "train.memory_budget_gib",
             "train.micro_batch_size", "train.micro_batch_tokens", "train.activation_checkpointing", "train.share_prompts",
             "train.return_host_memory", "rollout.vllm_url", "rollout.vllm_python", "rollout.vllm_verify_every",
             "rollout.vllm_threads")
ENV_KEYS = ("env.name", "env.options", "env.train_split", "env.toolworld.", "env.bfcl.", "env.acebench.",
            "env.humaneval.")  # which task the run trains on


def _leaves(tree: dict, prefix: str = "") -> dict[str, Any]:
    """A nested dict's leaves by dotted key (a dict-valued key with no entries is one leaf, `{}`)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _matches(key: str, patterns: Sequence[str]) -> bool:
    return any(key.startswith(p) if p.endswith(".") else key == p or key.startswith(p + ".") for p in patterns)


def config_changes(saved, cfg) -> list[tuple[str, Any, Any]]:
    """(dotted key, value in `saved`, value in `cfg`) for every key that differs and may not change on resume
    (`RESUMABLE`); file-path env names are compared as absolute paths."""
    from lopd.config import to_dict
    from lopd.envs import resolved_env_name

    old, new = _leaves(to_dict(saved)), _leaves(to_dict(cfg))
    old["env.name"], new["env.name"] = resolved_env_name(old["env.name"]), resolved_env_name(new["env.name"])
    return [(k, old.get(k, _UNSET), new.get(k, _UNSET)) for k in sorted(old.keys() | new.keys())
            if old.get(k, _UNSET) != new.get(k, _UNSET) and not _matches(k, RESUMABLE)]


_UNSET = object()  # a key one of two configs lacks (an env.options entry)


def _shown(value: Any) -> str:
    from lopd.config import as_override

    return "(unset)" if value is _UNSET else as_override(value)


def refuse_another_run(run: "RunDir", cfg) -> None:
    """A one-line ConfigError if `cfg` would not continue the run in `run` (its config.yaml): another env (its
    name, options or tasks: both named), or any other key outside `RESUMABLE` (named, with the keys that may
    change on resume). Nothing is written; called before the run directory is touched."""
    from lopd.config import load_config, to_dict

    saved = load_config(run.config_path)
    changes = config_changes(saved, cfg)
    if not changes:
        return
    if any(_matches(k, ENV_KEYS) for k, _, _ in changes):
        def env_of(c) -> str:
            options = to_dict(c)["env"]["options"]
            return repr(c.env.name) + (f" with options {options}" if options else "")
        others = [k for k, _, _ in changes if _matches(k, ENV_KEYS) and not _matches(k, ("env.name", "env.options"))]
        detail = f" (and {', '.join(others)} differ)" if others else ""
        raise ConfigError(f"{run.path}: this run trains on env {env_of(saved)}, and this process has env "
                          f"{env_of(cfg)}{detail}: a run never continues on another task; start another run "
                          f"(another run.dir) for it")
    key, was, now = changes[0]
    more = f" (and {', '.join(k for k, _, _ in changes[1:])})" if len(changes) > 1 else ""
    raise ConfigError(f"{run.path}: {key} is {_shown(was)} in this run, {_shown(now)} here{more}: a resumed run "
                      f"must be the run it was (its checkpoint's shapes, algorithm and training); keys that may "
                      f"change on resume: {', '.join(k + '*' if k.endswith('.') else k for k in RESUMABLE)}; "
                      f"start another run (another run.dir) for this config")


# ------------------------------------------------------------------------------ reading a run
# (importing this module loads no torch: the CLI checks a run's config before torch is imported)


@dataclass
class OpenRun:
    """A run directory opened to be read: its config (with any overrides) and its newest checkpoint."""

    run: RunDir | None  # None: a config's initial model, no run directory
    cfg: Any  # lopd.config.Config
    checkpoint: Path | None  # None: no checkpoint yet (the initial weights)

    @property
    def weights(self) -> str:
        """Which weights a reader of this run gets, in words."""
        return str(self.checkpoint) if self.checkpoint is not None else "initial weights"

    def load_model(self, device=None):
        """(model, tokenizer) with the newest checkpoint's weights (or the initial ones), on `device` (default:
        `train.device`)."""
        from lopd.models import load_policy, load_weights, pick_device

        model, tokenizer = load_policy(self.cfg.model, device if device is not None else pick_device(self.cfg.train.device))
        if self.checkpoint is not None:
            load_weights(model, self.checkpoint / "model")
        return model, tokenizer


def open_run(path: str | Path, overrides: Sequence[str] = ()) -> OpenRun:
    """A run directory's config and newest verified checkpoint; a one-line ConfigError if it is none."""
    from lopd.config import load_config

    run = RunDir(path)
    if not run.exists():
        raise ConfigError(f"{path}: not a run directory (no config.yaml)")
    return OpenRun(run, load_config(run.config_path, list(overrides)), run.latest_checkpoint())
