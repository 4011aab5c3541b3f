"""Python command lines started from a warm process: the tests' `lopd` CLI runs without ~6 s of imports each.

A real `python -m lopd.cli train ...` spends most of a tiny test run importing torch, transformers' Llama,
peft and matplotlib. The zygote (one per pytest worker, started on first use) imports those third-party
modules once, never runs a torch op, and forks one child per command line. The child is a real process of
its own: its pid, argv, environment, working directory, sys.path, standard streams and exit status (a
signal's as -N, as `subprocess` reports it) are the command's; it imports lopd itself afresh (lopd reads its
environment, e.g. LOPD_FAILPOINT, at import); signals sent to its pid act as on the plain command. Only the
interpreter's start and the preloaded third-party imports are shared. With `warm_children=True` the child's
`sys.executable` is a shim that runs the child's own Python children (`lopd compare`'s runs) the same way,
passing on the signals it gets (compare's SIGTERM) and exiting as they do.

    run([sys.executable, "-m", "lopd.cli", "train", ...], capture_output=True, text=True, timeout=600)
    proc = Popen([sys.executable, "-m", "lopd.cli", "compare", ...], stdout=subprocess.DEVNULL); proc.wait()
    start_processes(_rank, args=(world, port), nprocs=2)      # torch.multiprocessing's, one process per rank

Command lines that are not `python -m MODULE`, `python SCRIPT` or `python -c CODE` (and tests that measure a
fresh interpreter: the imports before the config check, the peak memory, third-party progress bars) use
`subprocess` itself. `LOPD_TEST_NO_ZYGOTE=1` sends everything to `subprocess`.
"""

from __future__ import annotations

import io
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

PRELOAD = ("torch", "torch.distributed.fsdp", "torch.multiprocessing", "transformers", "transformers.masking_utils",
           "transformers.models.llama.modeling_llama", "transformers.generation", "peft", "sentence_transformers",
           "safetensors.torch", "omegaconf", "yaml", "rich", "numpy", "filelock", "torch.utils.tensorboard",
           "matplotlib.figure", "matplotlib.image")


# ------------------------------------------------------------------------------------------------ the server

def serve(path: str) -> tuple[dict, list[int]]:
    """Accept command lines on the Unix socket `path`, fork a child for each and report its exit status on
    the same connection; exit when standard input closes (the starting process is gone). Returns only in a
    child: its request and its three standard-stream descriptors."""
    import gc
    import importlib

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for name in PRELOAD:
        importlib.import_module(name)
    figure = plt.figure(layout="constrained")  # loads the fonts every report's first picture needs
    figure.subplots(1, 2)[0].plot([0, 1], label="x")
    figure.legend()
    figure.savefig(io.BytesIO(), format="png")
    plt.close(figure)
    # Every forked child would otherwise walk (and so copy, page by page) the preloaded modules' ~500,000
    # objects in each garbage collection, its exit's included: ~2 s per command line on 2 cores. Frozen, the
    # collector leaves them alone (the pattern `gc.freeze` is documented for: before forking workers).
    gc.collect()
    gc.freeze()
    shim = Path(path).with_name("python")  # `python` for a child's own Python children: forwards to this zygote
    shim.write_text(f"#!{sys.executable} -S\nimport sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
                    f"from zygote import forward\nforward({path!r}, sys.argv[1:])\n")
    shim.chmod(0o755)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(path)
    server.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: dict[int, socket.socket] = {}
    print("ready", flush=True)
    while True:
        readable = select.select([server, wake_r, 0], [], [])[0]
        if 0 in readable and not os.read(0, 1):  # the pytest process that started us is gone
            os._exit(0)
        if wake_r in readable:
            os.read(wake_r, 4096)
            while children:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                conn = children.pop(pid)
                try:
                    conn.send(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode())
                except OSError:
                    pass  # the test stopped waiting
                conn.close()
        if server in readable:
            conn, _ = server.accept()
            message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            request = json.loads(message)
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for fd in (wake_r, wake_w):
                    os.close(fd)
                for c in [server, conn, *children.values()]:
                    c.close()
                return request, fds
            for fd in fds:
                os.close(fd)
            children[pid] = conn
            conn.send(json.dumps({"pid": pid}).encode())


def become(request: dict, fds: list[int]) -> None:
    """In the forked child: take the command's streams, environment, directory and argv, and run it as
    `python` would (`-m`: `runpy.run_module`; a script: `runpy.run_path`; `-c`: exec)."""
    import runpy

    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
        os.close(fd)
    env = request["env"]
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(env)
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=unbuffered,
                                  line_buffering=os.isatty(1))
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
    if request.get("warm_children"):
        sys.executable = request["warm_children"]
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS") or os.cpu_count() or 1))
    argv = request["argv"]
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if argv[0] == "-m":
        sys.path[:1] = [os.getcwd(), *extra]
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
        sys.path[:1] = ["", *extra]
        sys.argv = ["-c", *argv[2:]]
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
    else:
        sys.path[:1] = [str(Path(argv[0]).resolve().parent), *extra]
        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")


def forward(path: str, argv: list[str]) -> None:
    """The shim `python`: run `argv` in a child of the zygote at `path` with this process's streams,
    environment and directory, pass on the signals this process receives, and exit as the child did."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.connect(path)
    request = {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "warm_children": sys.executable}
    socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
    pid = json.loads(conn.recv(1 << 16))["pid"]
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, lambda number, _frame: os.kill(pid, number))
    code = json.loads(conn.recv(1 << 16))["exit"]
    if code < 0:  # died of a signal: so does the shim
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


# ------------------------------------------------------------------------------------------------ the client

_SERVER: list = []  # (process, socket path) of this process's zygote


def _zygote_path() -> str:
    if not _SERVER:
        folder = tempfile.mkdtemp(prefix="lopd-zygote-")
        path = os.path.join(folder, "socket")
        proc = subprocess.Popen([sys.executable, __file__, path], stdout=subprocess.PIPE, stdin=subprocess.PIPE,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        line = proc.stdout.readline()
        if line.strip() != b"ready":
            raise RuntimeError(f"the test zygote did not start (exit {proc.wait()})")
        _SERVER.append((proc, path, folder))
    return _SERVER[0][1]


def shutdown() -> None:
    """Stop this process's zygote (its running children go on)."""
    import shutil

    while _SERVER:
        proc, _, folder = _SERVER.pop()
        proc.kill()
        proc.wait()
        shutil.rmtree(folder, ignore_errors=True)


def _warm(cmd) -> bool:
    cmd = [str(c) for c in cmd]
    return (os.environ.get("LOPD_TEST_NO_ZYGOTE") != "1" and len(cmd) >= 2 and cmd[0] == sys.executable
            and not (cmd[1].startswith("-") and cmd[1] not in ("-m", "-c")))


def _stream(spec, std: int):
    """(the descriptor to hand the child for its stream `std`, one to close once handed, a read end to keep)."""
    if spec is None:
        return std, None, None  # inherited, as subprocess does
    if spec == subprocess.DEVNULL:
        fd = os.open(os.devnull, os.O_RDWR)
        return fd, fd, None
    if spec == subprocess.PIPE:
        r, w = os.pipe()
        return (r, r, w) if std == 0 else (w, w, r)
    return (spec if isinstance(spec, int) else spec.fileno()), None, None


class Popen:
    """The `subprocess.Popen` subset the tests use, for a command the zygote runs (else a real Popen)."""

    def __new__(cls, cmd, **kw):
        if not _warm(cmd):
            return subprocess.Popen(cmd, **kw)
        return super().__new__(cls)

    def __init__(self, cmd, stdin=None, stdout=None, stderr=None, env=None, cwd=None, text=False,
                 warm_children=False):
        self.args = [str(c) for c in cmd]
        self.returncode = None
        self.stdout = self.stderr = None
        handed, close = [], []
        for std, spec in enumerate((stdin, stdout, None if stderr == subprocess.STDOUT else stderr)):
            fd, to_close, keep = _stream(spec, std)
            handed.append(fd)
            close += [to_close] if to_close is not None else []
            if keep is not None and std == 0:
                raise NotImplementedError("stdin=PIPE: use subprocess")
            if keep is not None:
                setattr(self, ("stdout", "stderr")[std - 1], io.open(keep, "r" if text else "rb"))
        if stderr == subprocess.STDOUT:
            handed[2] = handed[1]
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._conn.connect(_zygote_path())
        request = {"argv": self.args[1:], "env": dict(env if env is not None else os.environ),
                   "cwd": str(cwd if cwd is not None else os.getcwd()),
                   "warm_children": str(Path(_zygote_path()).with_name("python")) if warm_children else None}
        socket.send_fds(self._conn, [json.dumps(request).encode()], handed)
        for fd in close:
            os.close(fd)
        self.pid = json.loads(self._conn.recv(1 << 16))["pid"]

    def poll(self):
        if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            self._finish()
        return self.returncode

    def wait(self, timeout=None):
        if self.returncode is None:
            if not select.select([self._conn], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._finish()
        return self.returncode

    def _finish(self):
        message = self._conn.recv(1 << 16)
        self._conn.close()
        self.returncode = json.loads(message)["exit"]

    def communicate(self, timeout=None):
        import threading

        outs = [None, None]
        readers = [threading.Thread(target=lambda i=i, s=s: outs.__setitem__(i, s.read()))
                   for i, s in enumerate((self.stdout, self.stderr)) if s is not None]
        for t in readers:
            t.start()
        for t in readers:
            t.join(timeout)
        self.wait(timeout)
        return tuple(outs)

    def send_signal(self, sig):
        if self.poll() is None:  # as subprocess: a process that has ended is not signalled
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        self.wait()


def start_processes(fn, args=(), nprocs: int = 1, timeout: float = 900) -> None:
    """`torch.multiprocessing.start_processes(fn, args, nprocs, join=True)` for a module-level `fn` of a test
    file: each of the `nprocs` processes runs `fn(i, *args)` (JSON-able args) and must exit 0."""
    folder = str(Path(fn.__code__.co_filename).resolve().parent)
    code = (f"import json, sys; sys.path.insert(0, {folder!r}); from {fn.__module__} import {fn.__name__} as fn; "
            "fn(*json.loads(sys.argv[1]))")
    procs = [Popen([sys.executable, "-c", code, json.dumps([i, *args])]) for i in range(nprocs)]
    codes = [p.wait(timeout) for p in procs]
    if any(codes):
        raise RuntimeError(f"{fn.__name__}: exit codes {codes}")


def run(cmd, *, capture_output=False, text=False, timeout=None, check=False, env=None, cwd=None, stdout=None,
        stderr=None, input=None, warm_children=False):
    """`subprocess.run` for a command the zygote runs (else `subprocess.run` itself)."""
    if not _warm(cmd) or input is not None:
        return subprocess.run(cmd, capture_output=capture_output, text=text, timeout=timeout, check=check, env=env,
                              cwd=cwd, stdout=stdout, stderr=stderr, input=input)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = Popen(cmd, stdout=out if capture_output else stdout, stderr=err if capture_output else stderr,
                     env=env, cwd=cwd, warm_children=warm_children)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        captured = []
        for f in (out, err):
            f.seek(0)
            data = f.read() if capture_output else None
            captured.append(data.decode(errors="replace") if text and data is not None else data)
    done = subprocess.CompletedProcess([str(c) for c in cmd], proc.returncode, *captured)
    if check:
        done.check_returncode()
    return done


if __name__ == "__main__":
    _request, _fds = serve(sys.argv[1])
    try:
        become(_request, _fds)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as error:  # the traceback `python` would print: without the zygote's own frames
        import traceback

        frames = error.__traceback__
        while frames is not None and frames.tb_frame.f_code.co_filename == __file__:
            frames = frames.tb_next
        traceback.print_exception(type(error), error, frames)
        sys.exit(1)
    sys.exit(0)
