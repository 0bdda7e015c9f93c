"""What a reader of the docs brings to a snippet (tests/_docs.py runs every code block): their model, data and
loss, small and on random data, so each snippet runs as written. A doc pulls it in with an invisible block:

    <!-- invisible-code-block: python
    from _doc_kit import *
    -->
"""

import torch
import torch.nn.functional as F
from torch import nn

import multigpu as mg

__all__ = ["F", "Net", "loss_fn", "mg", "nn", "start", "steps", "tokens", "torch", "train_set", "val_set"]

_g = torch.Generator().manual_seed(0)


class Net(nn.Sequential):
    """The reader's model: a small MLP over 8 features, 2 classes."""

    def __init__(self):
        super().__init__(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))


train_set = torch.utils.data.TensorDataset(torch.randn(1024, 8, generator=_g), torch.randint(0, 2, (1024,), generator=_g))
val_set = torch.utils.data.TensorDataset(torch.randn(200, 8, generator=_g), torch.randint(0, 2, (200,), generator=_g))
loss_fn = F.cross_entropy
steps = 12

_text = torch.randint(0, 256, (64 * 65 + 1,), generator=_g)
# GPT-style (input, next-token target) windows of 64 tokens over a byte vocabulary.
tokens = torch.utils.data.TensorDataset(torch.stack([_text[i * 65:i * 65 + 64] for i in range(64)]),
                                        torch.stack([_text[i * 65 + 1:i * 65 + 65] for i in range(64)]))


def start(seed: int = 0):
    """The ``dist`` of the ``with mg.init(seed=0) as dist:`` a fragment sits in (torn down at exit)."""
    ctx = mg.init(seed=seed)
    dist = ctx.__enter__()
    import atexit

    atexit.register(ctx.__exit__, None, None, None)
    return dist
