"""Worker for tests/test_hf_parallelize.py: a model people bring (a transformers Llama with grouped-query
attention, GPT-2 with its tied head, a plain nn.Module of blocks), trained under a ``Layout`` by
``mg.parallelize`` in float64, its full weights returned.

The one-process script and the parallel one differ only in the lines marked ``# +layout``: the layout,
``mg.parallelize`` and the batch plan the layout builds (what the issue allows: at most 5 lines).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import multigpu as mg

GLOBAL_BATCH, SEQ, VOCAB = 8, 16, 256


def tokens(n: int = 64, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    return TensorDataset(seq[:, :-1], seq[:, 1:])


class Block(nn.Module):
    """A pre-norm transformer block with the usual names (q/k/v/o, up/down) and heads left to ``view(-1)``."""

    def __init__(self, dim: int, n_head: int) -> None:
        super().__init__()
        self.n_head, self.head_dim = n_head, dim // n_head
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.Module()
        self.attn.q, self.attn.k, self.attn.v, self.attn.o = (nn.Linear(dim, dim) for _ in range(4))
        self.mlp = nn.Module()
        self.mlp.up, self.mlp.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.ln1(x)
        q, k, v = (p(h).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.attn.q, self.attn.k, self.attn.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        x = x + self.attn.o(a)
        return x + self.mlp.down(F.gelu(self.mlp.up(self.ln2(x))))


class TinyLM(nn.Module):
    def __init__(self, dim: int = 32, n_head: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(Block(dim, n_head) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(x) if positions is None else self.embed(x) + self.pos(positions)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


class PositionLM(TinyLM):
    """TinyLM with learned positions, read from ``position_ids`` when given (what context parallelism passes:
    each token's place in the whole sequence), else from the input's own length."""

    def __init__(self, arange_only: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        self.pos = nn.Embedding(64, self.embed.embedding_dim)
        if arange_only:  # a forward without position_ids: positions from its input's length, whatever it is
            self.forward = lambda x: TinyLM.forward(self, x, torch.arange(x.shape[1]))

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        positions = torch.arange(x.shape[1]) if position_ids is None else position_ids
        return TinyLM.forward(self, x, positions)


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary positions: (B, H, S, D) rotated by each token's position (B, S)."""
    half = x.shape[-1] // 2
    angle = positions[:, None, :, None].to(x.dtype) / 10000 ** (torch.arange(half, dtype=x.dtype) / half)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * angle.cos() - x2 * angle.sin(), x1 * angle.sin() + x2 * angle.cos()], -1)


class RopeBlock(Block):
    """Block with RoPE at the tokens' positions on q and k, causal SDPA, no mask of its own."""

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.ln1(x)
        q, k, v = (p(h).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.attn.q, self.attn.k, self.attn.v))
        a = F.scaled_dot_product_attention(rope(q, positions), rope(k, positions), v, is_causal=True)
        x = x + self.attn.o(a.transpose(1, 2).reshape(b, t, -1))
        return x + self.mlp.down(F.gelu(self.mlp.up(self.ln2(x))))


class RopeLM(nn.Module):
    """A user's hand-written causal LM: RoPE from ``position_ids`` and causal SDPA, no document mask of its own
    (packed documents restart its positions, nothing else: its attention crosses them on one process)."""

    def __init__(self, dim: int = 32, n_head: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(RopeBlock(dim, n_head) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        positions = (torch.arange(x.shape[1]) if position_ids is None else position_ids).expand(x.shape)
        h = self.embed(x)
        for block in self.blocks:
            h = block(h, positions)
        return self.head(self.norm(h))


class OwnExperts(nn.Module):
    """A user's own experts module in the convention expert parallelism spreads (docs/experts.md): an int
    ``num_experts``, 3-D weights with the expert first, ``forward(hidden, top_k_index, top_k_weights)``."""

    def __init__(self, dim: int, width: int, experts: int) -> None:
        super().__init__()
        self.num_experts = experts
        self.w_in = nn.Parameter(torch.randn(experts, width, dim) * dim ** -0.5)
        self.w_out = nn.Parameter(torch.randn(experts, dim, width) * width ** -0.5)

    def forward(self, hidden, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden)
        for e in range(self.num_experts):
            token, slot = torch.where(top_k_index == e)
            h = F.silu(hidden[token] @ self.w_in[e].T) @ self.w_out[e].T
            out.index_add_(0, token, h * top_k_weights[token, slot, None])
        return out


class OwnMoE(nn.Module):
    """TinyLM's shape with a routed MLP of 4 experts (or ``experts``), 2 per token: nothing transformers declares."""

    def __init__(self, dim: int = 32, layers: int = 2, experts: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.routers = nn.ModuleList(nn.Linear(dim, experts, bias=False) for _ in range(layers))
        self.experts = nn.ModuleList(OwnExperts(dim, 2 * dim, experts) for _ in range(layers))
        self.head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for router, experts in zip(self.routers, self.experts):
            flat = h.flatten(0, 1)
            weights, index = router(flat).softmax(-1).topk(2, dim=-1)
            h = h + experts(flat, index, weights).view_as(h)
        return self.head(h)


MOE_SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=1, pad_token_id=None,
                 tie_word_embeddings=False, num_experts_per_tok=2)
MOE = {"mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4)),
       "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(num_experts=4, moe_intermediate_size=32,
                                                                      shared_expert_intermediate_size=32)),
       "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(num_experts=4, moe_intermediate_size=32, head_dim=8)),
       "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=4))}

# kind -> (tiny sizes under the family's own config names, config class, model class)
ENCODERS = {
    "bert": (dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0), "BertConfig", "BertForTokenClassification"),
    "roberta": (dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=1),
                "RobertaConfig", "RobertaForTokenClassification"),
    "modernbert": (dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        local_attention=8, global_attn_every_n_layers=2, embedding_dropout=0.0, mlp_dropout=0.0,
                        attention_dropout=0.0, bos_token_id=2, eos_token_id=3, cls_token_id=2, sep_token_id=3,
                        mask_token_id=4), "ModernBertConfig", "ModernBertForTokenClassification"),
    "distilbert": (dict(dim=32, hidden_dim=64, n_layers=2, n_heads=4, dropout=0.0, attention_dropout=0.0),
                   "DistilBertConfig", "DistilBertForTokenClassification"),
}


def build(kind: str, **overrides):
    """A tiny model from a config (no download), in float64, the same on every rank (seed 0)."""
    torch.manual_seed(0)
    if kind == "own":
        return TinyLM(**overrides).double()
    if kind in ("own_positions", "own_arange"):
        return PositionLM(arange_only=kind == "own_arange", **overrides).double()
    if kind == "own_rope":
        return RopeLM(**overrides).double()
    if kind == "own_moe":
        return OwnMoE(**overrides).double()
    if kind.startswith("zoo:"):  # a family of the zoo (tests/_zoo.py), from its tiny config
        import _zoo

        model = _zoo.build(kind[4:])
        for k, v in overrides.items():  # read at run time (e.g. output_router_logits: the router's loss)
            setattr(model.config, k, v)
        return model
    import transformers

    if kind == "llama":
        cfg = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                   bos_token_id=0, eos_token_id=1, pad_token_id=None, tie_word_embeddings=False)
        config = transformers.LlamaConfig(**(cfg | overrides))
        cls = transformers.LlamaForCausalLM
    elif kind == "mistral":  # a sliding window (6) shorter than the sequence
        cfg = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=64, sliding_window=6, bos_token_id=0,
                   eos_token_id=1, pad_token_id=None, tie_word_embeddings=False)
        config = transformers.MistralConfig(**(cfg | overrides))
        cls = transformers.MistralForCausalLM
    elif kind == "qwen3":  # per-head RMSNorms on q and k (their weights shared by the heads each TP rank holds)
        cfg = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, max_position_embeddings=64, bos_token_id=0, eos_token_id=1,
                   pad_token_id=None, tie_word_embeddings=False)
        config = transformers.Qwen3Config(**(cfg | overrides))
        cls = transformers.Qwen3ForCausalLM
    elif kind == "gemma2":  # what a stage must keep of the model's forward: a mask per layer by its index in
        # config.layer_types (stage 1's first layer is a full-attention one), the logits soft-capped after the head
        cfg = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, max_position_embeddings=64, sliding_window=4,
                   layer_types=["sliding_attention", "full_attention", "full_attention", "sliding_attention"],
                   final_logit_softcapping=3.0, bos_token_id=0, eos_token_id=1, pad_token_id=None,
                   tie_word_embeddings=False)
        config = transformers.Gemma2Config(**(cfg | overrides))
        cls = transformers.Gemma2ForCausalLM
    elif kind == "granite":  # the logits divided by config.logits_scaling after the head
        cfg = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=64, logits_scaling=4.0, bos_token_id=0,
                   eos_token_id=1, pad_token_id=None, tie_word_embeddings=False)
        config = transformers.GraniteConfig(**(cfg | overrides))
        cls = transformers.GraniteForCausalLM
    elif kind == "phi3":  # fused nn.Linear projections: qkv_proj (q, k, v of unequal widths) and gate_up_proj
        cfg = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=1, pad_token_id=0,
                   tie_word_embeddings=False)
        config = transformers.Phi3Config(**(cfg | overrides))
        cls = transformers.Phi3ForCausalLM
    elif kind == "gpt_neox":  # query_key_value fused per head ([q, k, v] of head 0, of head 1, ...), declared colwise
        cfg = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   max_position_embeddings=64, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
        config = transformers.GPTNeoXConfig(**(cfg | overrides))
        cls = transformers.GPTNeoXForCausalLM
    elif kind in MOE:  # 4 experts, 2 per token; Qwen2-MoE with a shared expert
        config = getattr(transformers, MOE[kind][0])(**(MOE_SIZES | MOE[kind][2] | overrides))
        cls = getattr(transformers, MOE[kind][1])
        config._experts_implementation = "eager"  # a loop over the experts: grouped_mm takes no float64
    elif kind in ENCODERS:  # an encoder with a per-token head (VOCAB labels: the same loss as the causal LMs)
        name, config_cls, cls_name = ENCODERS[kind]
        cfg = dict(vocab_size=VOCAB, max_position_embeddings=64, num_labels=VOCAB, pad_token_id=0) | name
        config = getattr(transformers, config_cls)(**(cfg | overrides))
        cls = getattr(transformers, cls_name)
    elif kind == "vit":  # transformers' ViT for 16x16 images in patches of 4 (images() below), 10 classes
        config = transformers.ViTConfig(image_size=16, patch_size=4, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4, num_labels=10,
                                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **overrides)
        cls = transformers.ViTForImageClassification
    elif kind == "gpt2":
        cfg = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                   embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=1)
        config = transformers.GPT2Config(**(cfg | overrides))
        cls = transformers.GPT2LMHeadModel
    else:
        raise ValueError(kind)
    # Eager attention: plain matmuls and softmax, the same arithmetic on any layout (SDPA picks kernels by shape).
    config._attn_implementation = "eager"
    return cls(config).double()


def logits_of(model, x: torch.Tensor) -> torch.Tensor:
    out = model(x) if not hasattr(mg.unwrap(model), "config") else model(input_ids=x, use_cache=False)
    return out if isinstance(out, torch.Tensor) else out.logits


def documents(x: torch.Tensor) -> torch.Tensor:
    """Position ids of packed documents: one starts at every token divisible by 7 (and at the first)."""
    t = torch.arange(x.shape[1]).expand_as(x)
    starts = (x % 7 == 0) | (t == 0)
    return t - torch.where(starts, t, torch.zeros_like(t)).cummax(-1).values


def own_loss(model, x: torch.Tensor) -> torch.Tensor:
    """The model's own loss: ``labels=`` the inputs (transformers shifts them; under cp, multigpu does)."""
    return model(input_ids=x, labels=x, use_cache=False).loss


def lm_loss(model, x: torch.Tensor, y: torch.Tensor, divisor: torch.Tensor | None = None) -> torch.Tensor:
    """The next-token loss, plus the router's load-balancing loss where the model returns one (a mixture of
    experts with output_router_logits). ``divisor``: the rows are packed documents (position ids restart,
    the targets across a boundary ignored) and the loss is their sum over it (``mg.token_divisor``)."""
    more = {"position_ids": documents(x)} if divisor is not None else {}
    out = model(x, **more) if not hasattr(mg.unwrap(model), "config") else model(input_ids=x, use_cache=False, **more)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    y = mg.context_share(model, y)                                             # +layout (context parallelism)
    if divisor is not None:
        return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum") / divisor
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    aux = getattr(out, "aux_loss", None)
    return loss if aux is None else loss + mg.unwrap(model).config.router_aux_loss_coef * aux


def full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def max_diff(got: dict, ref: dict) -> float:
    """The largest difference of any parameter between two runs' full weights (the same names required)."""
    assert sorted(got["state"]) == sorted(ref["state"])
    return max((got["state"][k].double() - ref["state"][k]).abs().max().item() for k in ref["state"])


def train(dist, kind: str, layout: dict | None, steps: int = 5, accum: int = 2, clip: float = 0.5,
          ckpt: str | None = None, stop_after: int | None = None, overrides: dict | None = None,
          docs: bool = False, labels: bool = False) -> dict:
    """``layout``: the ``Layout``'s fields; every rank returns the same full weights after ``steps`` steps.
    ``layout=None``: the one-process script itself (no collective, so one rank of a larger world can run it).
    ``overrides``: the model's config beside build's defaults; ``ckpt``: resume from and save to that
    Checkpointer directory every step, stopping after step ``stop_after``."""
    model = build(kind, **(overrides or {}))
    if layout is None:
        dist = dataclasses.replace(dist, rank=0, local_rank=0, world_size=1, local_world_size=1)
        plan = mg.BatchPlan(GLOBAL_BATCH, 1, micro_batch=GLOBAL_BATCH // accum)
    else:
        micro = GLOBAL_BATCH // accum // mg.parallel.Layout(**layout).resolve(dist.world_size).dp_size
        layout = mg.parallel.Layout(**layout, micro_batch=micro)              # +layout
        model = mg.parallelize(model, layout)                                  # +layout
        plan = layout.plan(GLOBAL_BATCH, dist)                                 # +layout (was mg.BatchPlan(...))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    image = kind == "vit"  # images and a class each, else tokens and the next token for each
    train_loader = mg.loader(images() if image else tokens(), plan, dist, seed=0)
    start = 0
    if ckpt is not None:
        checkpointer = mg.Checkpointer(ckpt, model=model, optimizer=opt, loader=train_loader)
        start = checkpointer.resume()
    losses, norms = [], []
    for step, micro_batches in zip(range(start, steps), train_loader):
        total, divisor = 0.0, None
        if docs:  # a target across a document boundary is ignored: shares count unequal tokens
            micro_batches = [(x, y.masked_fill(y % 7 == 0, -100)) for x, y in micro_batches]
            shares = [mg.context_share(model, y) for _, y in micro_batches]
            # one process among other ranks (layout None) counts alone: token_divisor's count on one process
            divisor = mg.token_divisor(shares) if layout is not None else sum((y != -100).sum() for y in shares).double()
        for x, y in mg.accumulate(model, micro_batches):
            if image:
                loss = F.cross_entropy(image_logits(model, x), y) / plan.accum_steps
            elif docs:
                loss = lm_loss(model, x, y, divisor)
            elif labels:
                loss = own_loss(model, x) / plan.accum_steps
            else:
                loss = lm_loss(model, x, y) / plan.accum_steps
            loss.backward()
            total += float(loss.detach())
        norms.append(float(mg.clip_grad_norm_(model, clip)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
        if ckpt is not None:
            checkpointer.save(step)
            if step == stop_after:
                break
    state = {k: full(v) for k, v in mg.unwrap(model).state_dict().items()}
    return {"state": state, "losses": losses, "norms": norms, "strategy": mg.parallel.strategy_of(model), "start": start}


def train_layouts(dist, jobs: list[tuple[str, dict]]) -> list[dict]:
    """Several (model, layout) runs, one after another, in the same processes (one start-up for all)."""
    return [(train_pipeline if layout.get("pp", 1) > 1 else train)(dist, kind, layout) for kind, layout in jobs]


class ConvBlock(nn.Module):
    def __init__(self, ch: int) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(ch, ch, 3, padding=1), nn.Conv2d(ch, ch, 3, padding=1)

    def forward(self, x):
        return x + self.conv2(F.relu(self.conv1(x)))


class ConvNet(nn.Module):
    """A small ResNet-like net: a stage of repeated residual conv blocks (what TP cannot shard)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.stage = nn.Sequential(ConvBlock(8), ConvBlock(8))
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        return self.fc(self.stage(self.stem(x)).mean((2, 3)))


class Flat(nn.Module):
    """No repeated blocks: nothing to cut into pipeline stages."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(self.fc1(x))


class HeadsBlock(Block):
    """Block whose attention views q, k and v by its own head count (``view(b, t, self.n_head, ...)``), as many
    hand-written models do: under a split by heads each rank holds fewer, and the view fails."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.ln1(x)
        q, k, v = (p(h).view(b, t, self.n_head, self.head_dim).transpose(1, 2)
                   for p in (self.attn.q, self.attn.k, self.attn.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.attn.o(a)
        return x + self.mlp.down(F.gelu(self.mlp.up(self.ln2(x))))


class HeadsLM(TinyLM):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(HeadsBlock(32, 4) for _ in range(2))


class IdsLM(TinyLM):
    """TinyLM whose forward names its token ids as transformers models do: still called ``model(x)``."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return TinyLM.forward(self, input_ids)


class DropLM(TinyLM):
    """TinyLM with dropout on its last hidden states: a training forward that draws random numbers."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.drop(self.norm(h)))


class MixingExperts(OwnExperts):
    """OwnExperts centring the rows it is given on their mean: under expert parallelism a rank's experts are
    given other rows (those routed to them from every rank), so the result is not one process's."""

    def forward(self, hidden, top_k_index, top_k_weights):
        return OwnExperts.forward(self, hidden - hidden.mean(0), top_k_index, top_k_weights)  # self: a _Local under ep


class MixingMoE(OwnMoE):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(MixingExperts(32, 64, 4) for _ in range(2))


def jittery_phimoe():
    """The zoo's tiny PhiMoE with its router jitter as PhiMoE's config has it (0.01; the zoo sets it to 0): its
    training forward samples each token's expert."""
    import _zoo

    config = _zoo.tiny_config("phimoe")
    config.router_jitter_noise = 0.01
    torch.manual_seed(0)
    return getattr(__import__("transformers"), _zoo.families()["phimoe"])(config).double()


# Models of the probe's cases (the refusals below), beside build's kinds.
PROBED = {"heads": HeadsLM, "ids": IdsLM, "dropout": DropLM, "mixing_moe": MixingMoE, "phimoe_jitter": jittery_phimoe,
          "blocks": lambda: nn.Sequential(Block(32, 4), Block(32, 4))}


def refusal(dist, kind: str, layout: dict, overrides: dict | None = None, pipeline: bool = False, **kwargs) -> str:
    """The one line ``mg.parallelize`` (or ``mg.parallel.pipeline``) refuses with (every rank must refuse alike);
    "accepted" when it does not, followed by what rank 0 said of the probe (" | said: " and its lines that
    are notes or say it was not checked)."""
    import contextlib
    import io

    if pipeline:
        return pipeline_refusal(dist, kind, layout, overrides)
    torch.manual_seed(0)
    model = ConvNet().double() if kind == "conv" else PROBED[kind]().double() if kind in PROBED else \
        build(kind, **(overrides or {}))
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            mg.parallelize(model, mg.parallel.Layout(**layout), **kwargs)
    except mg.UsageError as e:
        return str(e)
    said = [line for line in out.getvalue().splitlines() if "note:" in line or "not checked" in line]
    return " | said: ".join(["accepted"] + said)


def refusals(dist, cases: list[dict]) -> list[str]:
    return [refusal(dist, **case) for case in cases]


def torchvision_problem() -> str | None:
    """Why torchvision cannot be used here (None if it can): PyPI's wheel is a CUDA build whose operators
    do not load beside the CPU torch ("operator torchvision::nms does not exist")."""
    try:
        import torchvision

        torchvision.ops.nms(torch.zeros(1, 4), torch.zeros(1), 0.5)
    except Exception as e:  # ImportError, or RuntimeError from the operator registry
        return f"torchvision unusable here: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    return None


def images(n: int = 32, seed: int = 2) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 3, 16, 16, generator=g, dtype=torch.float64), torch.randint(0, 10, (n,), generator=g))


def train_images(dist, kind: str, layout: dict, steps: int = 4) -> dict:
    """A conv net (torchvision's or transformers' ResNet-18, or ConvNet) on generated images under ``layout``, one micro-batch
    per step (BatchNorm's statistics then span the same samples as one process's, with sync_batchnorm)."""
    torch.manual_seed(0)
    if kind == "resnet18":
        import torchvision

        model = torchvision.models.resnet18(num_classes=10).double()
    elif kind == "hf_resnet18":
        model = hf_resnet18().double()
    else:
        model = ConvNet().double()
    layout = mg.parallel.Layout(**layout)                                  # +layout
    model = mg.parallelize(model, layout, sync_batchnorm=True)             # +layout
    plan = layout.plan(GLOBAL_BATCH, dist)                                 # +layout
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    for _, micro_batches in zip(range(steps), mg.loader(images(), plan, dist, seed=0)):
        for x, y in mg.accumulate(model, micro_batches):
            (F.cross_entropy(image_logits(model, x), y) / plan.accum_steps).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    state = {k: full(v) for k, v in mg.unwrap(model).state_dict().items()}
    return {"state": state, "strategy": mg.parallel.strategy_of(model)}


def hf_resnet18():
    """transformers' ResNet-18 (basic blocks, depths 2-2-2-2, widths 64-512: torchvision's resnet18, 11,181,642
    parameters with 10 classes), which needs no torchvision."""
    import transformers

    config = transformers.ResNetConfig(layer_type="basic", depths=[2, 2, 2, 2], hidden_sizes=[64, 128, 256, 512],
                                       embedding_size=64, num_labels=10)
    return transformers.ResNetForImageClassification(config)


def image_logits(model, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return out if isinstance(out, torch.Tensor) else out.logits


def train_image_layouts(dist, jobs: list[tuple[str, dict]]) -> list[dict]:
    return [train_images(dist, kind, layout) for kind, layout in jobs]


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def train_pipeline(dist, kind: str, layout: dict, steps: int = 5, accum: int = 4, clip: float = 0.5,
                   ckpt: str | None = None, stop_after: int | None = None, overrides: dict | None = None) -> dict:
    """``kind`` cut into stages by ``mg.parallel.pipeline``; the full weights gathered from the stages, the
    names of the parameters this rank's stages hold, and what the pipeline does with tied copies.
    ``overrides`` and ``ckpt`` as ``train``'s (the Checkpointer saves ``pipe.model``)."""
    model = build(kind, **(overrides or {}))
    micro = GLOBAL_BATCH // accum // mg.parallel.Layout(**layout).resolve(dist.world_size).dp_size
    layout = mg.parallel.Layout(**layout, micro_batch=micro)                # +layout
    plan = layout.plan(GLOBAL_BATCH, dist)                                   # +layout
    pipe = mg.parallel.pipeline(model, layout, loss_fn, plan)                # +layout (replaces the model's loop)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3, weight_decay=0.1)
    loader = mg.loader(tokens(), plan, dist, seed=0)
    start = 0
    if ckpt is not None:
        checkpointer = mg.Checkpointer(ckpt, model=pipe.model, optimizer=opt, loader=loader)
        start = checkpointer.resume()
    losses, norms = [], []
    for step, micro_batches in zip(range(start, steps), loader):
        loss = pipe.step(micro_batches)
        norms.append(float(pipe.clip_grad_norm_(clip)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(None if loss is None else float(loss))
        if ckpt is not None:
            checkpointer.save(step)
            if step == stop_after:
                break
    held = sorted({n for m in pipe.modules for n, _ in m.named_parameters(remove_duplicate=False)})
    # What the schedule's stages kept of the last step's outputs (the last stage's logits of every micro-batch,
    # unless the schedule is told not to return them).
    kept = sum(len(stage.output_chunks) for stage in pipe.stages)
    # Blocks whose forward mg.parallelize replaced by a recomputing one (activation checkpointing, spread.py).
    checkpointed = sum("forward" in vars(b) for m in pipe.modules for b in m.modules() if type(b).__name__.endswith(
        ("Block", "DecoderLayer")))
    return {"state": mg.full_state_dict(pipe), "losses": losses, "norms": norms, "stages": pipe.ids, "held": held,
            "tied": pipe.tied.sums != [], "counted_once": len(pipe.tied.skip), "checkpointed": checkpointed,
            "kept_outputs": kept}


def train_pipelines(dist, jobs: list[tuple[str, dict]]) -> list[dict]:
    return [train_pipeline(dist, kind, layout) for kind, layout in jobs]


def pipeline_refusal(dist, kind: str, layout: dict, overrides: dict | None = None) -> str:
    model = Flat().double() if kind == "flat" else build(kind, **(overrides or {}))
    layout = mg.parallel.Layout(**layout)
    try:
        mg.parallel.pipeline(model, layout, loss_fn, layout.plan(GLOBAL_BATCH, dist))
    except mg.UsageError as e:
        return str(e)
    return "accepted"



def train_in_two_layouts(dist, kind: str, first: dict, then: dict, ckpt: str) -> dict:
    """Steps 0-2 under ``first``, saved by the Checkpointer (DCP), then resumed under ``then`` to step 5."""
    train(dist, kind, first, ckpt=ckpt, stop_after=2)
    return train(dist, kind, then, ckpt=ckpt)


def train_any(dist, jobs: list[tuple[str, dict]]) -> list[dict]:
    """Each (kind, layout): a pipeline (``train_pipeline``) where the layout has pp > 1, else ``train``."""
    return [(train_pipeline if layout.get("pp", 1) > 1 else train)(dist, kind, layout) for kind, layout in jobs]


def tiny_vit():
    """transformers' ViT for 32x32 images in patches of 8, 2 layers (its blocks: ViTLayer, declared)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64,
                                    num_hidden_layers=2, num_attention_heads=4, num_labels=10)
    return transformers.ViTForImageClassification(config).double()


def fsdp_units(dist) -> dict:
    """The FSDP units of the same ViT by both entries, mg.wrap(model, "fsdp") and mg.parallelize."""
    from multigpu.parallel.fsdp import fsdp_modules

    out = {}
    for entry in ("wrap", "parallelize"):
        model = tiny_vit()
        model = mg.wrap(model, "fsdp") if entry == "wrap" else mg.parallelize(model, mg.parallel.Layout())
        names = {id(m): n for n, m in model.named_modules()}
        out[entry] = sorted(names[id(m)] for m in fsdp_modules(model))
    return out
