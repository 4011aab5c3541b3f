"""Third-party output that has no place on a lopd user's terminal: Hugging Face's progress bars
("Loading weights: 100%|...| 47/47 [00:00, 12950.49it/s]") and transformers' advisory warnings.

lopd prints its own progress line and one-line errors; these come from every model and tokenizer load.
`silence_third_party()` is what the CLI, `lopd.train` and `lopd.evaluate` call. It imports nothing heavy:
a library already imported is told directly, one not imported yet reads the environment variables set here
when it is, so the CLI can call it before the config is checked and a config error stays fast.
"""

from __future__ import annotations

import os
import sys


def silence_third_party() -> None:
    """No Hugging Face progress bars and only transformers' errors, from now on, in this process."""
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    else:
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    if "transformers" in sys.modules:
        from transformers.utils import logging

        logging.disable_progress_bar()
        logging.set_verbosity_error()
    else:
        os.environ["TRANSFORMERS_VERBOSITY"] = "error"
