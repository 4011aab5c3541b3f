"""Attack tests for the sandbox: each is a real attempt, run in every isolation mode this machine has.

A test whose guarantee does not hold in a mode (see `sandbox_guarantees`) is skipped there with the
reason, so the suite states exactly what each mode contains. Attacks run with small limits to keep the
suite light on a shared machine.
"""

from __future__ import annotations

import os
import signal
import socket
import stat
import tempfile
import textwrap
import uuid
from pathlib import Path

import pytest

from lopd.envs.sandbox import (MODES, NOBODY, STATUSES, UID_BASE, UID_POOL, SandboxUnavailable, _classify, last_error_line,
                               run_many, run_python, sandbox_guarantees)

REPO = Path(__file__).resolve().parents[1]
AS_ROOT = os.geteuid() == 0


@pytest.fixture(params=MODES)
def mode(request) -> str:
    try:
        sandbox_guarantees(request.param)
    except SandboxUnavailable as e:
        pytest.skip(f"isolation mode {request.param} unavailable here: {e}")
    return request.param


def needs(mode: str, guarantee: str) -> None:
    g = sandbox_guarantees(mode)[guarantee]
    if not g.holds:
        pytest.skip(f"{guarantee} does not hold in {mode} mode: {g.mechanism}")


def run(code: str, mode: str, **kwargs):
    kwargs.setdefault("timeout_s", 3.0)
    return run_python(textwrap.dedent(code), isolation=mode, **kwargs)


def leftovers(result) -> list[int]:
    """Live processes of a finished run's sandbox uid that started before it returned; [] when not root.
    Only this run's: the suite runs in parallel workers, whose sandbox runs hold other uids of the pool, and
    a uid released by this run may be leased again at once (a new run's processes start after the return)."""
    if result.uid is None:
        assert not AS_ROOT, "as root, every run drops to a sandbox uid"
        return []
    assert UID_BASE <= result.uid < UID_BASE + UID_POOL or result.uid == NOBODY, result.uid
    returned = float(Path("/proc/uptime").read_text().split()[0]) * os.sysconf("SC_CLK_TCK")
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status, stat_line = Path(f"/proc/{entry}/status").read_text(), Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        uid = int(next(ln for ln in status.splitlines() if ln.startswith("Uid:")).split()[1])
        state = next(ln for ln in status.splitlines() if ln.startswith("State:")).split()[1]
        started = int(stat_line.rsplit(")", 1)[1].split()[19])  # field 22, in clock ticks since boot
        if uid == result.uid and state != "Z" and started <= returned:
            found.append(int(entry))
    return found


# ------------------------------------------------------------------------- ordinary code


def test_normal_code_returns_output(mode):
    r = run("import sys\nprint('hello', sum(range(10)))\nprint(sys.stdin.read().upper())", mode, stdin="abc")
    assert (r.status, r.returncode, r.stdout) == ("ok", 0, "hello 45\nABC\n"), r
    assert r.ok and r.seconds < 3


def test_exceptions_and_exit_codes(mode):
    r = run("raise ValueError('bad value')", mode)
    assert (r.status, r.returncode, r.reason) == ("failed", 1, "ValueError: bad value")
    assert "Traceback" in r.stderr and "main.py" in r.stderr
    r = run("import sys\nprint('partial')\nsys.exit(3)", mode)
    assert (r.status, r.returncode, r.stdout) == ("failed", 3, "partial\n")
    r = run("def f(:\n    pass", mode)
    assert r.status == "failed" and r.reason.startswith("SyntaxError")


def test_run_many_keeps_order(mode):
    results = run_many([f"print({i} * {i})" for i in range(5)], workers=2, isolation=mode, timeout_s=3)
    assert [r.stdout for r in results] == [f"{i * i}\n" for i in range(5)]
    assert run_many([], workers=2) == []


def test_bad_arguments():
    with pytest.raises(ValueError, match="timeout_s"):
        run_python("pass", timeout_s=0)
    with pytest.raises(ValueError, match="isolation"):
        run_python("pass", isolation="docker")


def test_guarantees_listed(mode):
    g = sandbox_guarantees(mode)
    assert {"no_network", "process_limit", "parent_unsignalable", "tree_killed", "memory_limit"} <= set(g)
    if mode == "namespace" and AS_ROOT:
        assert all(x.holds for x in g.values()), {k: v for k, v in g.items() if not v.holds}


# ------------------------------------------------------------------------------- attacks


def test_fork_bomb_is_contained(mode):
    needs(mode, "process_limit")
    r = run("import os\nwhile True:\n    os.fork()", mode, max_processes=12, timeout_s=2)
    assert r.status == "process_limit", r
    assert "process limit of 12" in r.reason
    assert leftovers(r) == []


def test_fork_bomb_that_ignores_errors_is_killed(mode):
    code = """
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """
    r = run(code, mode, max_processes=8, timeout_s=1)
    assert r.status == "timeout", r
    assert r.seconds < 6
    assert leftovers(r) == []


def test_memory_bomb(mode):
    r = run("chunks = []\nwhile True:\n    chunks.append(bytearray(10**7))", mode, memory_mb=200)
    assert r.status == "memory", r
    assert "200 MB" in r.reason


def test_infinite_loop_hits_cpu_limit(mode):
    r = run("while True:\n    pass", mode, timeout_s=1)
    assert r.status == "timeout", r
    assert r.seconds < 4


def test_sleep_forever_hits_wall_clock(mode):
    r = run("import time\nprint('going to sleep')\ntime.sleep(1000)", mode, timeout_s=1)
    assert (r.status, r.returncode) == ("timeout", None), r
    assert "wall-clock" in r.reason and r.stdout == "going to sleep\n"
    assert r.seconds < 5


def test_huge_output_is_cut(mode):
    r = run("while True:\n    print('x' * 1000)", mode, max_output_bytes=100_000)
    assert r.status == "output_limit", r
    assert 0 < len(r.stdout) <= 100_000


def test_huge_stderr_is_cut(mode):
    r = run("import sys\nwhile True:\n    sys.stderr.write('e' * 1000)", mode, max_output_bytes=50_000)
    assert r.status == "output_limit", r


def test_huge_file(mode):
    r = run("f = open('big', 'wb')\nwhile True:\n    f.write(b'0' * (1 << 20))", mode, max_file_mb=4)
    assert r.status == "file_limit", r
    assert "File too large" in r.reason


def test_many_files_fill_only_the_sandbox_disk(mode):
    needs(mode, "disk_limit")
    code = "i = 0\nwhile True:\n    open(f'f{i}', 'wb').write(b'0' * (3 << 20))\n    i += 1"
    r = run(code, mode, max_file_mb=4, disk_mb=16)
    assert r.status == "file_limit", r
    assert "No space left" in r.reason


def test_too_many_open_files(mode):
    r = run("fs = [open('f', 'w') for _ in range(1000)]", mode, max_open_files=32)
    assert r.status == "file_limit" and "open-file limit" in r.reason, r


def _try_write(paths: list[str]) -> str:
    return "\n".join(f"""
try:
    with open({str(p)!r}, 'w') as f:
        f.write('escaped')
    print('wrote', {str(p)!r})
except OSError as e:
    print('refused', type(e).__name__)""" for p in paths)


def test_cannot_write_into_the_repo(mode):
    target = REPO / f"sandbox-escape-{uuid.uuid4().hex}"
    try:
        r = run(_try_write([str(target), str(REPO / "src" / "lopd" / "__init__.py")]), mode)
        assert r.status == "ok" and "wrote" not in r.stdout, r
        assert not target.exists()
    finally:
        target.unlink(missing_ok=True)


def test_writes_to_tmp_stay_inside(mode):
    needs(mode, "no_writes_outside")
    open_dir = tempfile.mkdtemp(prefix="lopd-sandbox-open-")
    os.chmod(open_dir, 0o777)  # world-writable: only the sandbox's own view of /tmp can stop this
    targets = [Path(tempfile.gettempdir()) / f"xyz-{uuid.uuid4().hex}", Path(open_dir) / "escaped"]
    try:
        r = run(_try_write([str(t) for t in targets]), mode)
        assert r.status == "ok", r
        for t in targets:
            assert not t.exists(), f"{t} written from the sandbox ({r.stdout!r})"
    finally:
        for t in targets:
            t.unlink(missing_ok=True)
        os.rmdir(open_dir)


def _try_read(paths: list[str]) -> str:
    return "\n".join(f"""
try:
    print('read', open({str(p)!r}).read())
except OSError as e:
    print('refused', type(e).__name__)""" for p in paths)


def test_cannot_read_a_private_home(mode):
    needs(mode, "parent_unsignalable")  # i.e. another uid or namespaces: a same-user run could read its home
    secret = uuid.uuid4().hex
    home = Path(tempfile.mkdtemp(prefix="lopd-home-"))  # 0700, like a real home directory
    (home / ".netrc").write_text(f"password {secret}\n")
    paths = [str(home / ".netrc")]
    root_secret = Path("/root") / f".lopd-sandbox-secret-{uuid.uuid4().hex}"
    if AS_ROOT:
        root_secret.write_text(secret)
        os.chmod(root_secret, 0o644)  # world-readable inside root's 0700 home
        paths.append(str(root_secret))
    try:
        r = run(_try_read(paths) + "\nimport os\nprint('home is', os.path.expanduser('~'))", mode)
        assert r.status == "ok" and secret not in r.stdout and "read" not in r.stdout.split(), r
        assert "home is /root" not in r.stdout
    finally:
        root_secret.unlink(missing_ok=True)
        (home / ".netrc").unlink()
        home.rmdir()


def test_cannot_read_world_readable_host_files(mode):
    needs(mode, "host_files_hidden")
    secret = uuid.uuid4().hex
    folder = Path(tempfile.mkdtemp(prefix="lopd-open-"))
    os.chmod(folder, 0o755)
    (folder / "notes.txt").write_text(secret)
    try:
        r = run(_try_read([str(folder / "notes.txt"), str(REPO / "pyproject.toml")]), mode)
        assert r.status == "ok" and secret not in r.stdout and "[project]" not in r.stdout, r
    finally:
        (folder / "notes.txt").unlink()
        folder.rmdir()


def test_no_network_to_a_listening_loopback_port(mode):
    needs(mode, "no_network")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        code = f"""
            import socket
            s = socket.socket()
            s.settimeout(2)
            s.connect(('127.0.0.1', {port}))
            s.sendall(b'leak')
            print('connected')
        """
        r = run(code, mode)
        assert r.status == "failed" and "connected" not in r.stdout, r
        assert "Network is unreachable" in r.reason or "refused" in r.reason.lower()
        server.setblocking(False)
        with pytest.raises(BlockingIOError):
            server.accept()


def test_cannot_signal_the_parent_or_the_test_process(mode):
    needs(mode, "parent_unsignalable")
    code = f"""
        import os, signal
        for name, pid in (('parent', os.getppid()), ('test', {os.getpid()}), ('all', -1)):
            try:
                os.kill(pid, signal.SIGKILL)
                print(name, 'sent')
            except OSError as e:
                print(name, 'refused', type(e).__name__)
        print('still here')
    """
    r = run(code, mode)
    assert r.status == "ok" and "still here" in r.stdout, r  # the launcher survived to report it
    assert "test sent" not in r.stdout
    os.kill(os.getpid(), 0)  # and so did we


def test_parent_environment_is_not_visible(mode, monkeypatch):
    secret = uuid.uuid4().hex
    monkeypatch.setenv("LOPD_SANDBOX_TEST_SECRET", secret)
    monkeypatch.setenv("PYTHONSTARTUP", "/nonexistent.py")
    r = run("import os\nprint(dict(os.environ))\nprint(open('/proc/self/environ').read())", mode)
    assert r.status == "ok" and secret not in r.stdout, r
    assert "LOPD_SANDBOX_TEST_SECRET" not in r.stdout and "PYTHONSTARTUP" not in r.stdout


def test_background_processes_die_with_the_run(mode):
    needs(mode, "tree_killed")
    code = """
        import os, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                time.sleep(60)
            os._exit(0)
        print('main done')
    """
    r = run(code, mode)
    assert r.status == "ok", r
    assert leftovers(r) == []


def test_each_run_has_a_fresh_folder_that_is_deleted(mode):
    first = run("import os\nopen('left.txt', 'w').write('x')\nprint(os.getcwd())", mode)
    second = run("import os\nprint(os.listdir('.'))", mode)
    assert first.ok and second.ok
    assert "left.txt" not in second.stdout
    cwd = first.stdout.strip()
    if mode == "process":  # a host folder: it must be gone
        assert not os.path.exists(cwd)


# ------------------------------------------------------------------- status bookkeeping


def test_classification_without_running():
    limits = dict(timeout_s=2.0, memory_mb=64, max_processes=4, max_file_mb=1, max_open_files=16, disk_mb=8)
    assert _classify({"exit": 0}, "", "", limits, 10)[0] == "ok"
    assert _classify({"signal": int(signal.SIGXCPU)}, "", "", limits, 10)[:2] == ("timeout", -int(signal.SIGXCPU))
    assert _classify({"signal": int(signal.SIGSEGV)}, "", "", limits, 10) == ("killed", -11, "killed by SIGSEGV")
    assert _classify({"setup_error": "OSError: x"}, "", "", limits, 10)[0] == "error"
    assert _classify({}, "", "", limits, 10)[0] == "error"
    assert _classify({"exit": 1}, "", "Traceback\nMemoryError\n", limits, 10)[0] == "memory"
    assert set(s for s in STATUSES) >= {"ok", "failed", "timeout", "memory", "output_limit"}
    interleaved = "Traceback\n  os.fork()\nBlockingIOError: [Errno 11] no\nos.fork()\n"
    assert last_error_line(interleaved) == "BlockingIOError: [Errno 11] no"
    # a fork bomb's children write their tracebacks at once: the last exception line may lose its message
    # (seen in make test: 'BlockingIOError' alone), and an earlier child's may hold it
    cut = "Traceback (most recent call last):\nTraceback (most recent call last):\n  os.fork()\nBlockingIOError\n"
    assert _classify({"exit": 1}, "", cut, limits, 10)[:2] == ("process_limit", 1)
    earlier = "BlockingIOError: [Errno 11] Resource temporarily unavailable\nValueError: x\n"
    assert _classify({"exit": 1}, "", earlier, limits, 10)[0] == "process_limit"
    assert _classify({"exit": 1}, "", "Traceback\nValueError: x\n", limits, 10) == ("failed", 1, "ValueError: x")


def test_stdin_file_is_not_left_in_the_folder(mode):
    r = run("import os, sys\nprint(sys.stdin.read(), sorted(os.listdir('.')))", mode, stdin="data")
    assert r.stdout == "data ['main.py']\n", r


def test_only_standard_streams_are_inherited(mode):
    r = run("import os\nprint(sorted(int(f) for f in os.listdir('/proc/self/fd')))", mode)
    assert r.ok and r.stdout == "[0, 1, 2, 3]\n", r  # 3: the listdir itself


def test_work_folder_is_private(mode):
    r = run("import os, stat\nprint(oct(os.stat('.').st_mode & 0o777))", mode)
    assert r.ok and r.stdout.strip() == oct(stat.S_IRWXU), r
