"""Failpoints: named places where a test can make this process die with a real SIGKILL.

    LOPD_FAILPOINT=checkpoint.rename:2 lopd train ...     # killed the 2nd time that point is reached

Production runs never set the variable, and then every call is a dictionary lookup and nothing more. The
fault-injection tests (tests/test_faults.py) kill runs at each point and check that the resumed run equals
an uninterrupted one bit for bit. Points: rollout, update, eval, remember, bank.append, metrics.write
(half a row written), checkpoint.write, checkpoint.rename (the row logged, the folder not yet renamed),
checkpoint.after_rename, step.end.
"""

from __future__ import annotations

import os
import signal

_hits: dict[str, int] = {}


def _target() -> tuple[str, int] | None:
    spec = os.environ.get("LOPD_FAILPOINT")
    if not spec:
        return None
    name, _, count = spec.partition(":")
    return name, int(count or 1)


def reached(name: str, last_words=None) -> None:
    """Count a pass through `name`; on the configured pass, call `last_words()` (e.g. write half a line)
    and die by SIGKILL."""
    target = _target()
    if target is None or target[0] != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] == target[1]:
        if last_words is not None:
            last_words()
        os.kill(os.getpid(), signal.SIGKILL)
