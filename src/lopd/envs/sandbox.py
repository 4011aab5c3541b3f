"""Run untrusted, model-written Python in an isolated, resource-limited child process.

    result = run_python("print(sum(range(10)))", timeout_s=2)
    result.status, result.stdout            # -> "ok", "45\\n"
    run_many([code_a, code_b], workers=2)   # many completions, results in input order

Design
------
Every run starts a fresh *launcher* (this file run as a script by the parent's interpreter,
`python -I -S -B sandbox.py`, so it imports nothing but the standard library) in its own session. The
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

import ctypes
import json
import math
import os
import platform
import re
import resource
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Sequence

STATUSES = ("ok", "failed", "timeout", "memory", "process_limit", "file_limit", "output_limit", "killed", "error")
MODES = ("namespace", "process")

UID_BASE = 1_000_000_000  # per-run sandbox uids: UID_BASE .. UID_BASE + UID_POOL - 1 (own no file anywhere)
UID_POOL = 64
LOCK_DIR = "/run/lopd-sandbox-uids"  # per-uid lease files (root only)
NOBODY = 65534  # fallback when the uid range above is not mapped (a user-namespaced container)
START_GRACE_S = 1.0  # wall-clock allowance for starting the launcher and interpreter, on top of timeout_s
KILL_WAIT_S = 2.0  # how long to drain output / wait for the launcher after a kill
SYSTEM_RO_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
DEVICES = ("null", "zero", "full", "random", "urandom")
_LAUNCH_FLAG = "--lopd-sandbox-launcher"


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

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass(frozen=True)
class Guarantee:
    holds: bool
    mechanism: str  # what enforces it, or why it does not hold


STDERR_KEEP = 16_000


# =========================================================================================
# Launcher side: runs as `python -I -S -B sandbox.py --lopd-sandbox-launcher` (standard library only).
# =========================================================================================

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 18, 1 << 21
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}

_libc_handle = None


def _libc() -> ctypes.CDLL:
    global _libc_handle
    if _libc_handle is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
        lib.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
        lib.unshare.argtypes = [ctypes.c_int]
        lib.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        _libc_handle = lib
    return _libc_handle


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _b(path: str | None) -> bytes | None:
    return None if path is None else os.fsencode(path)


def _mount(src: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(_libc().mount(_b(src), _b(target), _b(fstype), flags, _b(data)), f"mount {src} on {target}")


def _prctl(option: int, arg: int = 0) -> None:
    _check(_libc().prctl(option, arg, 0, 0, 0), f"prctl({option})")


def _report(ctl: int, **fields) -> None:
    """One JSON line on the control pipe (short lines are written atomically)."""
    line = json.dumps(fields)[:3000] + "\n"
    try:
        os.write(ctl, line.encode())
    except OSError:
        pass


def _guard(ctl: int, fn) -> None:
    """Run the body of a forked child; any exception is a set-up error. Never returns."""
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 (anything here is a set-up failure to report)
        _report(ctl, setup_error=f"{type(e).__name__}: {e}")
    os._exit(125)


def _check_alive(alive_r: int) -> None:
    """Exit if the launcher is gone (closes the race before the parent-death signal was armed)."""
    os.set_blocking(alive_r, False)
    try:
        if os.read(alive_r, 1) == b"":
            os._exit(124)
    except BlockingIOError:
        pass


def _set_rlimits(lim: dict) -> None:
    mb = 1 << 20
    cpu = max(1, math.ceil(lim["timeout_s"]))
    wanted = {
        resource.RLIMIT_CPU: (cpu, cpu + 1),  # SIGXCPU at the soft limit, SIGKILL one second later
        resource.RLIMIT_AS: (lim["memory_mb"] * mb,) * 2,
        resource.RLIMIT_NPROC: (lim["max_processes"],) * 2,
        resource.RLIMIT_FSIZE: (lim["max_file_mb"] * mb,) * 2,
        resource.RLIMIT_NOFILE: (lim["max_open_files"],) * 2,
        resource.RLIMIT_CORE: (0, 0),
    }
    for which, (soft, hard) in wanted.items():
        old_hard = resource.getrlimit(which)[1]
        if old_hard != resource.RLIM_INFINITY:
            hard = min(hard, old_hard)
        resource.setrlimit(which, (min(soft, hard), hard))


def _exec_user(spec: dict, alive_r: int, workdir: str) -> None:
    """In the forked user process: stdin, limits, drop privileges, exec the interpreter."""
    os.chdir(workdir)
    stdin_path = os.path.join(workdir, ".stdin")
    fd = os.open(stdin_path if os.path.exists(stdin_path) else "/dev/null", os.O_RDONLY)
    if fd != 0:
        os.dup2(fd, 0)
        os.close(fd)
    if os.path.exists(stdin_path):
        os.unlink(stdin_path)
    _set_rlimits(spec["limits"])
    uid = spec["uid"]
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # re-armed: a uid change clears it
    _check_alive(alive_r)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": spec["tmpdir"] or workdir,
           "LANG": "C.UTF-8"}
    python = spec["python"]
    os.execve(python, [python, "-I", "-B", "-u", "main.py"], env)


def _write_program(spec: dict, workdir: str) -> None:
    uid = spec["uid"]
    for name, text in (("main.py", spec["code"]), (".stdin", spec["stdin"])):
        if name == ".stdin" and not text:
            continue
        path = os.path.join(workdir, name)
        with open(path, "wb") as f:
            f.write(text.encode("utf-8", "replace"))
        if uid is not None and name == "main.py":
            os.chown(path, uid, uid)
        os.chmod(path, 0o644 if name == "main.py" else 0o600)
    if uid is not None:
        os.chown(workdir, uid, uid)
    os.chmod(workdir, 0o700)


def _supervise(pid: int) -> dict:
    """Reap children until `pid` exits; its status as control-pipe fields."""
    while True:
        try:
            got, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return {"lost": True}
        if got == pid:
            if os.WIFSIGNALED(status):
                return {"signal": os.WTERMSIG(status)}
            return {"exit": os.WEXITSTATUS(status)}


# ----------------------------------------------------------------------- namespace mode


def _mount_flags(path: str) -> int:
    """The locked flags of the mount holding `path` (a read-only remount must keep them)."""
    st = os.statvfs(path).f_flag
    out = 0
    for st_bit, ms_bit in ((1, MS_RDONLY), (2, MS_NOSUID), (4, MS_NODEV), (8, MS_NOEXEC), (1024, MS_NOATIME),
                           (2048, MS_NODIRATIME), (4096, MS_RELATIME)):
        if st & st_bit:
            out |= ms_bit
    return out


def _build_root(spec: dict) -> None:
    """Mount a tmpfs root holding read-only binds of the system, pivot into it, drop the old root."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    sources = [p for p in dict.fromkeys([*SYSTEM_RO_PATHS, *spec["ro_paths"]]) if os.path.lexists(p)]
    links = {p: os.readlink(p) for p in sources if os.path.islink(p)}
    binds = {p: (os.open(p, os.O_PATH), _mount_flags(p), os.path.isdir(p)) for p in sources if p not in links}
    devices = {d: os.open(f"/dev/{d}", os.O_PATH) for d in DEVICES if os.path.exists(f"/dev/{d}")}
    new = "/tmp"  # any directory: the tmpfs mounted over it (in this private namespace) becomes the root
    _mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, f"size={spec['limits']['disk_mb']}m,mode=755")
    for path, target in links.items():
        os.makedirs(os.path.dirname(new + path), exist_ok=True)
        os.symlink(target, new + path)
    for path, (fd, flags, is_dir) in binds.items():
        _bind_ro(f"/proc/self/fd/{fd}", new + path, flags, is_dir)
        os.close(fd)
    os.makedirs(new + "/dev", exist_ok=True)
    for name, fd in devices.items():
        _bind_ro(f"/proc/self/fd/{fd}", f"{new}/dev/{name}", MS_NOSUID | MS_NOEXEC, is_dir=False, read_only=False)
        os.close(fd)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{new}/dev/{name}")
    for d in ("/tmp", "/dev/shm"):
        os.makedirs(new + d, exist_ok=True)
        os.chmod(new + d, 0o1777)
    os.makedirs(new + "/work", exist_ok=True)
    os.makedirs(new + "/proc", exist_ok=True)
    try:  # a fresh /proc shows only this PID namespace; refused in some user namespaces, then left empty
        _mount("proc", new + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError:
        pass
    os.chdir(new)
    _check(_libc().syscall(ctypes.c_long(SYS_PIVOT_ROOT[platform.machine()]), ctypes.c_char_p(b"."),
                           ctypes.c_char_p(b".")), "pivot_root")
    _check(_libc().umount2(b".", MNT_DETACH), "umount old root")
    os.chdir("/")


def _bind_ro(src: str, target: str, flags: int, is_dir: bool, read_only: bool = True) -> None:
    if is_dir:
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    _mount(src, target, None, MS_BIND | MS_REC)
    _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_NOSUID | flags | (MS_RDONLY if read_only else 0))


def _write_id_maps(uid: int, gid: int) -> None:
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def _launch_namespace(spec: dict, ctl: int) -> None:
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    if spec["userns"]:
        flags |= CLONE_NEWUSER
    _check(_libc().unshare(flags), "unshare")
    if spec["userns"]:
        _write_id_maps(uid, gid)
    alive_r, alive_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(alive_w)
        _guard(ctl, lambda: _ns_init(spec, ctl, alive_r))
    os.close(alive_r)
    _supervise(pid)  # the init reports the user process's status itself
    os._exit(0)


def _ns_init(spec: dict, ctl: int, alive_r: int) -> None:
    """PID 1 of the new namespace: build the root, start the user process, report its status."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    _check_alive(alive_r)
    _build_root(spec)
    _write_program(spec, "/work")
    pid = os.fork()
    if pid == 0:
        _guard(ctl, lambda: _exec_user(spec, alive_r, "/work"))
    _report(ctl, **_supervise(pid))
    os._exit(0)  # PID 1 exits: the kernel kills whatever the user process left behind


# ------------------------------------------------------------------------- process mode


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _kill_descendants() -> None:
    """SIGKILL every descendant (orphans re-parent to us, a subreaper) until none is left."""
    me = os.getpid()
    for _ in range(200):
        pids = _descendants(me)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        while True:
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        time.sleep(0.005)


def _on_term(signum, frame) -> None:
    """Process mode, on the parent's timeout (SIGTERM), its death or the alarm: kill the tree, then go."""
    _kill_descendants()
    os._exit(0)


def _launch_process(spec: dict, ctl: int) -> None:
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    workdir = spec["workdir"]
    _write_program(spec, workdir)
    alive_r, alive_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(alive_w)
        _guard(ctl, lambda: _exec_user(spec, alive_r, workdir))
    os.close(alive_r)
    status = _supervise(pid)
    _kill_descendants()
    _report(ctl, **status)
    os._exit(0)


def _launcher_main() -> None:
    """Entry point of the launcher process. Two backstops against a parent that dies mid-run: the
    parent-death signal, and an alarm after the longest time the parent itself would wait."""
    os.umask(0o022)
    spec = json.loads(sys.stdin.buffer.read())
    ctl = spec["ctl_fd"]
    os.set_inheritable(ctl, False)  # the user program must not be able to write fake status lines
    if spec["mode"] == "namespace":
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the init follows by its own parent-death signal
    else:
        signal.signal(signal.SIGTERM, _on_term)
        signal.signal(signal.SIGALRM, _on_term)
        _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != spec["parent_pid"]:
        os._exit(124)
    signal.alarm(math.ceil(spec["limits"]["timeout_s"] + START_GRACE_S + 2 * KILL_WAIT_S))
    launch = _launch_namespace if spec["mode"] == "namespace" else _launch_process
    _guard(ctl, lambda: launch(spec, ctl))


# =========================================================================================
# Parent side
# =========================================================================================


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
                    [sys.executable, "-I", "-S", "-B", os.path.abspath(__file__), _LAUNCH_FLAG],
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
    return ExecResult(status, returncode, stdout, stderr, reason, time.monotonic() - start)


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
    if "[Errno 11]" in last or "can't start new thread" in last:
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


if __name__ == "__main__" and sys.argv[1:] == [_LAUNCH_FLAG]:
    _launcher_main()
