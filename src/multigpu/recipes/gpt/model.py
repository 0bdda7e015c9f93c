"""A decoder-only GPT: pre-LN blocks, causal attention through ``F.scaled_dot_product_attention``, GELU MLP.

Written for every layout multigpu runs: the blocks sit in an ``nn.ModuleDict``
keyed ``"0"``, ``"1"``, ... so parameter names (``blocks.3.attn.q.weight``)
stay the same when a pipeline keeps only some of them, which DCP checkpoints
need to reshard across layouts; attention reshapes with ``-1`` heads, so a
tensor-parallel rank runs its share of the heads unchanged; and the
embedding and the output head share one matrix as in GPT-2 (``tie_embeddings``):
both shard it by vocabulary rows under tensor parallelism, so the tie
survives every layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import UsageError


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of a GPT. ``vocab_size`` 256 reads bytes; GPT-2 124M is ``SIZES["gpt2"]``."""

    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise UsageError(f"n_embd {self.n_embd} is not divisible by n_head {self.n_head}; "
                             f"use n_embd={self.n_embd // self.n_head * self.n_head} or another n_head")

    @property
    def mlp_width(self) -> int:
        """The MLP's hidden units (GPT-2's 4 x n_embd): what tensor parallelism splits in it."""
        return 4 * self.n_embd

    @property
    def parameters(self) -> int:
        """Parameters, embeddings included: 12·L·h² (blocks, weights) plus biases, norms, tables and head."""
        h, L, V = self.n_embd, self.n_layer, self.vocab_size
        block = 12 * h * h + 13 * h  # q, k, v, out (4h²+4h), up/down (8h²+5h), two LayerNorms (4h)
        return V * h * (1 if self.tie_embeddings else 2) + self.block_size * h + L * block + 2 * h

    def flops_per_token(self) -> float:
        """Training FLOPs per token, 6N + 12·L·h·s (PaLM, Chowdhery et al. 2022, appendix B).

        N counts every weight but the position table (a lookup), as nanoGPT's
        ``estimate_mfu`` does; a tied token table counts once, for the head.
        """
        n = self.parameters - self.block_size * self.n_embd
        return 6 * n + 12 * self.n_layer * self.n_embd * self.block_size


# tiny: < 1M parameters, for tests; small: a CPU-sized model; gpt2: GPT-2 124M (vocab padded to 50304,
# a multiple of 64 and of every tensor-parallel degree up to 64).
SIZES = {
    "tiny": GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64),
    "small": GPTConfig(vocab_size=256, block_size=256, n_layer=6, n_head=6, n_embd=384),
    "gpt2": GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768),
}


def config(size: str, **overrides) -> GPTConfig:
    """``SIZES[size]`` with ``overrides`` (e.g. ``block_size=128``)."""
    if size not in SIZES:
        raise UsageError(f"unknown GPT size {size!r}; expected one of {', '.join(SIZES)}")
    return replace(SIZES[size], **overrides)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.q = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.k = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.v = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.out = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.head_dim = cfg.n_embd // cfg.n_head
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism q, k and v hold this rank's heads only.
        q, k, v = (proj(x).view(b, t, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.n_embd, cfg.mlp_width)
        self.down = nn.Linear(cfg.mlp_width, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-LN block. ``checkpointed``: keep only its input for the backward and recompute the rest
    (activation checkpointing, non-reentrant ``torch.utils.checkpoint``; parameter names unchanged)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)
        self.checkpointed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed and torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint

            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Embeddings(nn.Module):
    """Token plus learned position embeddings: one module, so a layout can shard its output as a whole."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))


class GPT(nn.Module):
    """``GPT(cfg)(idx)`` -> logits ``(batch, time, vocab)``; built with the caller's seed, weights as GPT-2's."""

    # Its blocks, declared as transformers models declare theirs: mg.parallelize shards, checkpoints and
    # compiles per Block by this, also in a pipeline stage that kept one block (nothing repeated to find).
    _no_split_modules = ["Block"]

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = Embeddings(cfg)
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layer)})
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.apply(self._init)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.wte.weight
        # GPT-2's scaled init of the projections into the residual stream (Radford et al. 2019).
        for name, p in self.named_parameters():
            if name.endswith(("attn.out.weight", "mlp.down.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids -> logits; a pipeline stage without ``embed`` takes, or without ``head`` returns, hidden states."""
        if idx.shape[1] > self.cfg.block_size:
            raise UsageError(f"sequence of {idx.shape[1]} tokens is longer than block_size {self.cfg.block_size}; "
                             "cut it or build the model with a larger block_size")
        x = self.embed(idx) if self.embed is not None else idx
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.ln_f(x)) if self.head is not None else x
