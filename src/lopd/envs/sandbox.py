"""Run untrusted, model-written Python in an isolated, resource-limited child process.

    result = run_python("print(sum(range(10)))", timeout_s=2)
    result.status, result.stdout            # -> "ok", "45\\n"
    run_many([code_a, code_b], workers=2)   # many completions, results in input order

Design
------
Every run starts a fresh *launcher* (`sandbox_launcher.py`, run as a script by the parent's interpreter,
`python -I -S -B`, so it imports nothing but the standard library) in its own session. The
parent sends it a JSON spec on stdin (code, limits, mode) and reads three pipes back: the program's
stdout, its stderr and a control pipe on which the launcher reports the exit status or a set-up error.
The launcher is needed because the isolation steps (`unshare`, mounts, `pivot_root`, `setuid`) must
happen in a process that is not the (multi-threaded) parent, and a new PID namespace applies only to
processes forked after `unshare`.

Two isolation modes; `auto` picks the strongest that works on this machine (probed once per process):

`namespace` (root, or an unprivileged user namespace):
    launcher: unshare(mount, PID, network, IPC, UTS [, user]) -> fork
    init (PID 1 of the new PID namespace, still privileged): parent-death signal = SIGKILL; builds a
        new root on a size-limited tmpfs (read-only binds of /usr, /bin, /lib*, /etc and the
        interpreter's prefix; /dev/{null,zero,full,random,urandom}; a fresh /proc; writable /tmp and
        /work), `pivot_root`s into it and detaches the old root -> fork
    user process (PID 2): rlimits -> drop to a per-run uid (root mode) -> no_new_privs -> exec
        `python -I -B -u main.py` in /work with a five-variable environment.
    When PID 1 exits (user process done) or is killed (the parent SIGKILLs the launcher on a timeout,
    the init follows by its parent-death signal), the kernel kills every process in the namespace, and
    the tmpfs -- the only writable place -- disappears with its mount namespace.

`process` (no namespaces, e.g. a container whose seccomp profile forbids `unshare`):
    launcher: child subreaper -> fork; user process: rlimits -> drop to a per-run uid if root ->
    no_new_privs -> exec in a fresh temporary folder the parent creates and deletes. On exit or SIGTERM
    the launcher SIGKILLs every descendant (orphans re-parent to it, a subreaper).

Per-run uids: as root, each concurrent run gets its own uid from `UID_BASE + [0, UID_POOL)` (a
cross-process `flock` lease), so RLIMIT_NPROC (counted per uid) contains one run's fork bomb without
starving a sibling run, and runs cannot signal or read each other. Root itself is exempt from
RLIMIT_NPROC, which is why the uid drop is what makes the process limit real.

`sandbox_guarantees()` lists each guarantee, whether it holds in the chosen mode and what enforces it;
docs/sandbox.md explains them. Nothing here needs a package beyond the standard library and Linux.
"""

from __future__ import annotations

import json
import math
import os
import re
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Sequence

from lopd.envs import sandbox_launcher
from lopd.envs.sandbox_launcher import KILL_WAIT_S, LAUNCH_FLAG, START_GRACE_S

STATUSES = ("ok", "failed", "timeout", "memory", "process_limit", "file_limit", "output_limit", "killed", "error")
MODES = ("namespace", "process")

UID_BASE = 1_000_000_000  # per-run sandbox uids: UID_BASE .. UID_BASE + UID_POOL - 1 (own no file anywhere)
UID_POOL = 64
LOCK_DIR = "/run/lopd-sandbox-uids"  # per-uid lease files (root only)
NOBODY = 65534  # fallback when the uid range above is not mapped (a user-namespaced container)


class SandboxUnavailable(RuntimeError):
    """The requested isolation mode cannot run on this machine."""


@dataclass(frozen=True)
class ExecResult:
    status: str  # one of STATUSES
    returncode: int | None  # exit code, -signal if killed by a signal, None if the sandbox killed it or failed
    stdout: str  # at most max_output_bytes
    stderr: str  # the last STDERR_KEEP characters
    reason: str  # one line: why this status
    seconds: float  # wall-clock time of the whole run
    uid: int | None = None  # the uid the code ran as (as root: its leased per-run uid); None: the caller's

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass(frozen=True)
class Guarantee:
    holds: bool
    mechanism: str  # what enforces it, or why it does not hold


STDERR_KEEP = 16_000


@dataclass(frozen=True)
class _Mode:
    kind: str  # "namespace" | "process"
    userns: bool  # namespace mode through an unprivileged user namespace
    uids: tuple[int, ...] | None  # None: run as the caller's uid (not root)
    python: str  # the interpreter that runs model code
    prefix: str  # its installation prefix (bound read-only in namespace mode)


def _interpreters() -> list[tuple[str, str]]:
    """(interpreter, prefix): the base interpreter of this Python (not the venv), then the system one."""
    base = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    out = [(base, sys.base_prefix)]
    system = "/usr/bin/python3"
    if os.path.exists(system) and os.path.realpath(system) != base:
        out.append((os.path.realpath(system), "/usr"))
    return out


def _candidates(kind: str) -> list[_Mode]:
    root = os.geteuid() == 0
    pool = tuple(range(UID_BASE, UID_BASE + UID_POOL))
    uid_sets: list[tuple[int, ...] | None] = [pool, (NOBODY,)] if root else [None]
    return [_Mode(kind, kind == "namespace" and not root, uids, python, prefix)
            for uids in uid_sets for python, prefix in _interpreters()]


_probe_lock = threading.Lock()
_probed: dict[str, _Mode | str] = {}  # kind -> working mode, or why none works


def _mode(isolation: str) -> _Mode:
    if isolation not in ("auto", *MODES):
        raise ValueError(f"isolation must be 'auto' or one of {', '.join(MODES)}; got {isolation!r}")
    kinds = MODES if isolation == "auto" else (isolation,)
    with _probe_lock:
        for kind in kinds:
            if kind not in _probed:
                _probed[kind] = _probe(kind)
            if isinstance(_probed[kind], _Mode):
                return _probed[kind]
    raise SandboxUnavailable("; ".join(f"{k}: {_probed[k]}" for k in kinds))


def _probe(kind: str) -> _Mode | str:
    """The first candidate configuration that runs a trivial program, or the last failure."""
    why = "no candidate"
    for mode in _candidates(kind):
        result = _run(mode, "print('ok')", dict(timeout_s=10.0, memory_mb=512, max_processes=8, max_file_mb=1,
                                                max_open_files=64, disk_mb=16), "", 10_000, ())
        if result.status == "ok" and result.stdout == "ok\n":
            return mode
        why = f"{result.status}: {result.reason}"
    return why


def _lock_dir() -> str:
    """/run/lopd-sandbox-uids: never in a world-writable place a process-mode sandbox could squat."""
    path = LOCK_DIR
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    import stat

    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise SandboxUnavailable(f"{path} must be a directory owned by uid {os.geteuid()} with mode 0700")
    return path


class _UidLease:
    """A uid for one run: an exclusive flock on `<lockdir>/<uid>.lock`, shared only in the NOBODY fallback."""

    def __init__(self, uids: tuple[int, ...] | None):
        self.uids, self.fd, self.uid = uids, -1, None

    def __enter__(self) -> int | None:
        if self.uids is None or len(self.uids) == 1:
            self.uid = None if self.uids is None else self.uids[0]
            return self.uid
        import fcntl

        lockdir = _lock_dir()
        while True:
            for uid in self.uids:
                fd = os.open(os.path.join(lockdir, f"{uid}.lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                self.fd, self.uid = fd, uid
                return uid
            time.sleep(0.05)

    def __exit__(self, *exc) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # releases the lock


def _collect(proc: subprocess.Popen, ctl_r: int, deadline: float, limit: int,
             terminate) -> tuple[bytes, bytes, bytes, str]:
    """Read stdout, stderr and the control pipe until all close; kill on the deadline or the output limit."""
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    bufs = {out_fd: bytearray(), err_fd: bytearray(), ctl_r: bytearray()}
    sel = selectors.DefaultSelector()
    for fd in bufs:
        sel.register(fd, selectors.EVENT_READ)
    total, why, stop_at = 0, "", None
    while sel.get_map():
        now = time.monotonic()
        if not why and now >= deadline:
            why, stop_at = "timeout", now + KILL_WAIT_S
            terminate()
        if stop_at is not None and now >= stop_at:
            break
        for key, _ in sel.select(max(0.0, (stop_at or deadline) - now)):
            data = os.read(key.fd, 1 << 16)
            if not data:
                sel.unregister(key.fd)
            elif key.fd == ctl_r:
                bufs[ctl_r] += data
            else:
                if key.fd == out_fd:
                    bufs[out_fd] += data[: max(0, limit - len(bufs[out_fd]))]
                else:
                    bufs[err_fd] = (bufs[err_fd] + data)[-4 * STDERR_KEEP:]
                total += len(data)
                if total > limit and not why:
                    why, stop_at = "output_limit", time.monotonic() + KILL_WAIT_S
                    terminate()
    sel.close()
    return bytes(bufs[out_fd]), bytes(bufs[err_fd]), bytes(bufs[ctl_r]), why


def _terminate(proc: subprocess.Popen, mode: _Mode) -> None:
    """Namespace mode: SIGKILL the launcher (the init follows by its parent-death signal, then the whole
    namespace). Process mode: SIGTERM, so the launcher kills the tree first; SIGKILL comes later if needed."""
    try:
        if mode.kind == "namespace":
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            os.kill(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass


def _run(mode: _Mode, code: str, limits: dict, stdin: str, max_output_bytes: int,
         ro_paths: Sequence[str]) -> ExecResult:
    with _UidLease(mode.uids) as uid:
        start = time.monotonic()
        workdir = tempfile.mkdtemp(prefix="lopd-sandbox-") if mode.kind == "process" else None
        ctl_r, ctl_w = os.pipe()
        proc = None
        try:
            spec = {"mode": mode.kind, "userns": mode.userns, "uid": uid, "python": mode.python, "code": code,
                    "stdin": stdin, "limits": limits, "workdir": workdir, "tmpdir": "/tmp" if workdir is None else None,
                    "ro_paths": [mode.prefix, *ro_paths], "ctl_fd": ctl_w, "parent_pid": os.getpid()}
            try:
                proc = subprocess.Popen(
                    [sys.executable, "-I", "-S", "-B", os.path.abspath(sandbox_launcher.__file__), LAUNCH_FLAG],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(ctl_w,),
                    env={"PATH": "/usr/bin:/bin"}, cwd="/", start_new_session=True)
            finally:
                os.close(ctl_w)
            try:
                with proc.stdin:
                    proc.stdin.write(json.dumps(spec).encode())
            except BrokenPipeError:
                pass
            deadline = start + limits["timeout_s"] + START_GRACE_S
            with proc.stdout, proc.stderr:
                out, err, ctl, why = _collect(proc, ctl_r, deadline, max_output_bytes, lambda: _terminate(proc, mode))
            _reap(proc)
            if why and mode.uids is not None and len(mode.uids) > 1:  # an exclusive uid: all its processes are ours
                _await_uid_gone(uid)
        except BaseException:  # e.g. KeyboardInterrupt while waiting: leave nothing running
            if proc is not None:
                _terminate(proc, mode)
                _reap(proc)
            raise
        finally:
            os.close(ctl_r)
            if workdir is not None:
                _rmtree(workdir)
    stdout, stderr = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")[-STDERR_KEEP:]
    status, returncode, reason = _classify(_control_fields(ctl), why, stderr, limits, max_output_bytes)
    return ExecResult(status, returncode, stdout, stderr, reason, time.monotonic() - start, uid)


def _reap(proc: subprocess.Popen) -> None:
    try:
        proc.wait(timeout=KILL_WAIT_S)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def _uid_processes(uid: int) -> list[int]:
    """Live (not zombie) processes whose real uid is `uid`."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/status") as f:
                    fields = dict(ln.split(":", 1) for ln in f.read().splitlines() if ":" in ln)
            except (OSError, ValueError):
                continue
            if int(fields.get("Uid", "-1").split()[0]) == uid and not fields.get("State", "").strip().startswith("Z"):
                out.append(int(entry))
    return out


def _await_uid_gone(uid: int) -> None:
    """After a kill, wait until the run's processes have finished dying (the kernel tears a PID namespace
    down asynchronously), SIGKILLing stragglers, so the uid is free when its lease is released."""
    end = time.monotonic() + KILL_WAIT_S
    while (pids := _uid_processes(uid)) and time.monotonic() < end:
        if time.monotonic() > end - KILL_WAIT_S / 2:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        time.sleep(0.01)


def _rmtree(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def _control_fields(ctl: bytes) -> dict:
    fields: dict = {}
    for line in ctl.decode("utf-8", "replace").splitlines():
        try:
            fields.update(json.loads(line))
        except json.JSONDecodeError:
            continue
    return fields


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Warning)\b(:.*)?$")


def error_lines(stderr: str) -> list[str]:
    """Every `ExcType: message` line of stderr (one per traceback; several when processes wrote at once)."""
    return [ln.strip() for ln in stderr.splitlines() if _EXCEPTION_LINE.match(ln.strip())]


def _out_of_processes(line: str) -> bool:
    """fork()/clone() refused by RLIMIT_NPROC: EAGAIN (BlockingIOError, whose ': [Errno 11] ...' another
    process's write may have cut off), or a thread that could not start."""
    return "[Errno 11]" in line or line.startswith("BlockingIOError") or "can't start new thread" in line


def last_error_line(stderr: str) -> str:
    """The final `ExcType: message` line of a traceback (the last such line if processes interleaved)."""
    lines = [ln.strip() for ln in stderr.strip().splitlines() if ln.strip()]
    for line in reversed(lines):
        if _EXCEPTION_LINE.match(line):
            return line
    return lines[-1] if lines else ""


def _classify(ctl: dict, why: str, stderr: str, limits: dict, max_output_bytes: int) -> tuple[str, int | None, str]:
    """(status, returncode, reason) from the control report, the parent's own kill reason and stderr."""
    if why == "timeout":
        return "timeout", None, f"wall-clock limit of {limits['timeout_s']:g} s exceeded"
    if why == "output_limit":
        return "output_limit", None, f"output exceeded {max_output_bytes} bytes"
    if "setup_error" in ctl and "exit" not in ctl and "signal" not in ctl:
        return "error", None, f"sandbox set-up failed: {ctl['setup_error']}"
    if "signal" in ctl:
        sig = ctl["signal"]
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
        if sig == signal.SIGXCPU:
            return "timeout", -sig, f"CPU time limit of {max(1, math.ceil(limits['timeout_s']))} s exceeded"
        if sig == signal.SIGXFSZ:
            return "file_limit", -sig, f"file size limit of {limits['max_file_mb']} MB exceeded"
        if "MemoryError" in stderr or "Cannot allocate memory" in stderr:
            return "memory", -sig, f"memory limit of {limits['memory_mb']} MB exceeded (killed by {name})"
        return "killed", -sig, f"killed by {name}"
    if "exit" not in ctl:
        return "error", None, "sandbox launcher ended without a status"
    code, last = ctl["exit"], last_error_line(stderr)
    if code == 0:
        return "ok", 0, "exited with code 0"
    if last.startswith("MemoryError") or "Cannot allocate memory" in stderr:
        return "memory", code, f"memory limit of {limits['memory_mb']} MB exceeded ({last or 'MemoryError'})"
    if "[Errno 27]" in last or "[Errno 28]" in last:
        return "file_limit", code, f"file size / disk limit exceeded ({last})"
    if "[Errno 24]" in last:
        return "file_limit", code, f"open-file limit of {limits['max_open_files']} reached ({last})"
    if any(_out_of_processes(line) for line in error_lines(stderr)):  # any child's: forked writers interleave
        return "process_limit", code, f"process limit of {limits['max_processes']} reached ({last})"
    return "failed", code, last or f"exited with code {code}"


# ------------------------------------------------------------------------------ public API


def run_python(code: str, *, timeout_s: float = 5.0, memory_mb: int = 512, max_processes: int = 32,
               max_file_mb: int = 16, max_open_files: int = 64, max_output_bytes: int = 1 << 20,
               disk_mb: int = 64, stdin: str = "", ro_paths: Sequence[str] = (),
               isolation: str = "auto") -> ExecResult:
    """Run `code` as `main.py` in a fresh sandbox; never raises for anything the code does.

    timeout_s: wall-clock limit (plus START_GRACE_S for start-up) and, rounded up, the CPU-time limit.
    memory_mb: address-space limit. max_processes: processes + threads of the run's uid.
    max_file_mb: largest file. disk_mb: all files together (namespace mode: the tmpfs size).
    max_open_files: file descriptors. max_output_bytes: stdout + stderr, killed beyond it.
    stdin: text fed to the program. ro_paths: extra host paths visible read-only (namespace mode).
    isolation: 'auto' (strongest available), 'namespace' or 'process'; SandboxUnavailable if impossible.
    """
    for name, value in (("timeout_s", timeout_s), ("memory_mb", memory_mb), ("max_processes", max_processes),
                        ("max_file_mb", max_file_mb), ("max_open_files", max_open_files),
                        ("max_output_bytes", max_output_bytes), ("disk_mb", disk_mb)):
        if not value > 0:
            raise ValueError(f"{name} must be positive, got {value!r}")
    limits = dict(timeout_s=float(timeout_s), memory_mb=int(memory_mb), max_processes=int(max_processes),
                  max_file_mb=int(max_file_mb), max_open_files=int(max_open_files), disk_mb=int(disk_mb))
    return _run(_mode(isolation), code, limits, stdin, int(max_output_bytes), tuple(ro_paths))


def run_many(codes: Sequence[str], workers: int = 2, stdins: Sequence[str] | None = None,
             **kwargs) -> list[ExecResult]:
    """`run_python` over many programs, `workers` sandboxes at a time; results in input order.

    stdins: one stdin text per program (instead of a shared `stdin=`); other keywords go to run_python."""
    if stdins is not None and (len(stdins) != len(codes) or "stdin" in kwargs):
        raise ValueError("run_many: give one stdin per program in `stdins`, or a shared `stdin`, not both")
    if not codes:
        return []
    _mode(kwargs.get("isolation", "auto"))  # probe once, before the threads race for it
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> ExecResult:
        return run_python(codes[i], **({"stdin": stdins[i]} if stdins is not None else {}), **kwargs)

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(one, range(len(codes))))


def sandbox_mode(isolation: str = "auto") -> str:
    """The mode `run_python(isolation=...)` uses here, e.g. 'namespace (root, per-run uid)'."""
    m = _mode(isolation)
    who = "user namespace" if m.userns else ("root, per-run uid" if m.uids and len(m.uids) > 1 else
                                             "root, shared uid 65534" if m.uids else "unprivileged")
    return f"{m.kind} ({who}; python {m.python})"


def sandbox_guarantees(isolation: str = "auto") -> dict[str, Guarantee]:
    """Each guarantee of `run_python` in the mode `isolation` resolves to here, and what enforces it."""
    m = _mode(isolation)
    ns = m.kind == "namespace"
    uid_drop = m.uids is not None
    per_run_uid = uid_drop and len(m.uids) > 1
    g = Guarantee
    return {
        "separate_process": g(True, "a fresh launcher + interpreter per run"),
        "wall_clock_limit": g(True, "parent deadline (timeout_s + start-up grace), then the tree is killed"),
        "cpu_limit": g(True, "RLIMIT_CPU (SIGXCPU, SIGKILL one second later)"),
        "memory_limit": g(True, "RLIMIT_AS"),
        "process_limit": g(uid_drop or m.userns,
                           ("RLIMIT_NPROC on a per-run uid" if per_run_uid else "RLIMIT_NPROC on uid 65534, "
                            "shared by concurrent runs") if uid_drop else
                           "RLIMIT_NPROC counted in the run's own user namespace" if m.userns else
                           "RLIMIT_NPROC counts every process of the calling user: not a per-run limit"),
        "file_size_limit": g(True, "RLIMIT_FSIZE"),
        "disk_limit": g(ns, "size-limited tmpfs is the only writable place" if ns else
                        "none: only RLIMIT_FSIZE per file"),
        "open_files_limit": g(True, "RLIMIT_NOFILE"),
        "output_limit": g(True, "the parent stops reading and kills the tree at max_output_bytes"),
        "fresh_workdir": g(True, "tmpfs in a private mount namespace, gone with it" if ns else
                           "a new temporary folder, deleted afterwards"),
        "scrubbed_env": g(True, "execve with PATH, HOME, TMPDIR, LANG only; python -I ignores PYTHON* variables"),
        "no_network": g(ns, "new network namespace (loopback only, down)" if ns else
                        "none: needs namespaces"),
        "host_files_hidden": g(ns, "pivot_root into a tmpfs root with read-only binds of system dirs" if ns else
                               ("uid drop: files not readable by others stay hidden; world-readable ones are not"
                                if uid_drop else "none: the code reads what the caller's user can")),
        "no_writes_outside": g(ns, "read-only binds; only the tmpfs is writable" if ns else
                               "partial: the uid drop stops writes to the repo and root's files, but world-writable "
                               "directories (/tmp, /var/tmp, /dev/shm) stay writable" if uid_drop
                               else "none: the code writes where the caller's user can"),
        "parent_unsignalable": g(ns or uid_drop, "new PID namespace" + (" and a different uid" if uid_drop else "")
                                 if ns else "different uid" if uid_drop else
                                 "none: same uid, same PID namespace"),
        "tree_killed": g(True, "PID 1 of the namespace exits or dies by its parent-death signal: the kernel kills "
                         "the rest" if ns else "the launcher is a child subreaper and SIGKILLs all descendants"),
        "concurrent_runs_isolated": g(per_run_uid or (ns and not uid_drop),
                                      "per-run uid" + (" and namespaces" if ns else "") if per_run_uid else
                                      "separate namespaces" if ns else "shared uid"),
    }

