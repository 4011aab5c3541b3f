"""Failpoints: named places where a test can make this process die with a real SIGKILL, or run a command.

    LOPD_FAILPOINT=checkpoint.rename:2 lopd train ...     # killed the 2nd time that point is reached
    LOPD_FAILPOINT=remember:1 LOPD_FAILPOINT_RUN="mount -o remount,bind,ro RUN" lopd train ...
                                                          # ... or that shell command runs there, and the run goes on

Production runs never set the variable, and then every call is a dictionary lookup and nothing more. The
fault-injection tests (tests/test_faults.py) kill runs at each point and check that the resumed run equals
an uninterrupted one bit for bit. Points: rollout, update, eval, remember, bank.append, metrics.write
(half a row written), checkpoint.write, checkpoint.rename (the row logged, the folder not yet renamed),
checkpoint.after_rename, step.end. With LOPD_FAILPOINT_RUN the process does not die at the point: the
command runs (it must succeed) and the run continues, e.g. into a run directory that just turned read-only.
"""

from __future__ import annotations

import os
import signal
import subprocess

_hits: dict[str, int] = {}


def _target() -> tuple[str, int] | None:
    spec = os.environ.get("LOPD_FAILPOINT")
    if not spec:
        return None
    name, _, count = spec.partition(":")
    return name, int(count or 1)


def reached(name: str, last_words=None) -> None:
    """Count a pass through `name`; on the configured pass, run LOPD_FAILPOINT_RUN if set, else call
    `last_words()` (e.g. write half a line) and die by SIGKILL."""
    target = _target()
    if target is None or target[0] != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] == target[1]:
        if os.environ.get("LOPD_FAILPOINT_RUN"):
            subprocess.run(os.environ["LOPD_FAILPOINT_RUN"], shell=True, check=True)
            return
        if last_words is not None:
            last_words()
        os.kill(os.getpid(), signal.SIGKILL)
