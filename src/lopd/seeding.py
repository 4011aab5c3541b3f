"""The random streams of a run: seeding them at the start, and their state in a checkpoint.

Python's `random`, NumPy's global generator and torch's (CPU and every CUDA device) are seeded together from
`train.seed`; a checkpoint holds all of their states, so a resumed run draws the numbers the uninterrupted run
would have drawn. torch and NumPy are imported inside the functions: reading a run directory needs neither.
"""

from __future__ import annotations

import random


def rng_state() -> dict:
    import numpy as np
    import torch

    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(state: dict) -> None:
    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
