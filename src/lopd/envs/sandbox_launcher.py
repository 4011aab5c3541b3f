"""The launcher side of `lopd.envs.sandbox`: the process that isolates and runs one program.

The parent (`sandbox.py`) starts this file as a script, `python -I -S -B sandbox_launcher.py
--lopd-sandbox-launcher`, sends it a JSON spec on stdin and reads the program's stdout, stderr and a
control pipe back; `sandbox.py`'s docstring describes both modes and every isolation step. Running with
`-I -S`, this file imports nothing but the standard library (not even lopd): keep it that way.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import platform
import resource
import signal
import sys
import time

START_GRACE_S = 1.0  # wall-clock allowance for starting the launcher and interpreter, on top of timeout_s
KILL_WAIT_S = 2.0  # how long to drain output / wait for the launcher after a kill
SYSTEM_RO_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
DEVICES = ("null", "zero", "full", "random", "urandom")
LAUNCH_FLAG = "--lopd-sandbox-launcher"

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


if __name__ == "__main__" and sys.argv[1:] == [LAUNCH_FLAG]:
    _launcher_main()
