"""Through the Python API, as through the CLI, no Hugging Face progress bar or advisory warning reaches
the terminal (lopd.quiet)."""

import subprocess
import sys
import textwrap

from conftest import small_overrides


def test_api_train_and_evaluate_show_no_third_party_progress_bars(tmp_path, capfd):
    """A fresh interpreter (nothing silenced yet) trains and evaluates the tiny policy through `lopd`:
    its stderr, captured at the file descriptor, has no progress bar and no 'Loading' line."""
    overrides = small_overrides(tmp_path / "run", **{"train.max_rollouts": 8, "eval.max_tasks": 2,
                                                      "rollout.max_new_tokens": 8})
    script = textwrap.dedent(f"""
        import lopd
        cfg = lopd.load_config(None, {overrides!r})
        run = lopd.train(cfg)
        print("evaluated", lopd.evaluate(run, splits=["test"])[0].n)
    """)
    rc = subprocess.run([sys.executable, "-c", script], timeout=300).returncode
    out, err = capfd.readouterr()
    assert rc == 0, err[-2000:]
    assert "evaluated 2" in out
    assert "it/s]" not in err and "Loading" not in err and "%|" not in err, err[-2000:]
