"""What one sequence costs a model, counted without memory: the model is built and run on fake tensors.

``FakeTensorMode`` gives every parameter and activation its shape and dtype and no storage, so a 405B model
is built and run forward in seconds on a laptop. One forward of one sequence (micro-batch 1) with its loss
is watched by ``FlopCounterMode`` (FLOPs, PyTorch's own per-op formulas: a matmul's 2mnk, attention's
full s x s whatever its mask, as torchtitan counts) and by autograd's saved-tensor hooks (the bytes kept for
the backward, each storage once, the weights left out); forward hooks on each repeated block split both
per block. Nothing here is a formula of a family: a model the library never saw is counted the same way.
A mixture of experts' experts modules (what ``mg.parallelize`` spreads under ``ep``: ``parallel/experts.py``
finds them) are counted apart too: their parameters, FLOPs (transformers 5 runs them through
``torch._grouped_mm``, given its formula here: 2 x rows x in x out, each row one expert's) and the bytes
their dispatch would send (the top-k rows of every token).

Everything is per token of a sequence of ``seq_len`` (FLOPs of attention grow with it; saved bytes do
not, with a fused attention kernel, which is what the count runs: ``sdpa``). On fake tensors transformers
takes its tracing path: an explicit causal mask and the K/V heads repeated before attention (as torchtitan's
Llama does), where eager transformers passes ``is_causal`` and ``enable_gqa``. The mask is left out (s bytes
and more per token: at 262,144 tokens it alone was 8 GiB a GPU); the repeated heads stay, so the saved bytes of
a grouped-query model count a few % above eager transformers' (5 % on tests' tiny Llama). Each block's saved
bytes are also split by where tensor parallelism leaves them whole (``block_unsplit``, ``block_gathered``).
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils import _pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import UsageError
from ..meter.flops import GROUPED, flop_counter
from ..parallel.auto import block_stack, head_counts


@dataclass(frozen=True)
class Counts:
    name: str
    seq_len: int
    dtype_bytes: int                      # bytes per element of the compute dtype (bf16: 2)
    block_params: tuple[int, ...]          # per repeated block (the unit FSDP, TP and PP cut at)
    block_sharded: tuple[int, ...]         # of those, in weights of 2+ dimensions (what TP shards)
    embed_params: int                      # input tables outside the blocks
    head_params: int                       # the output projection (0 when tied to the input table)
    other_params: int                      # the rest (final norm, ...)
    block_flops: tuple[float, ...]         # forward FLOPs per token of each block
    other_flops: float                     # forward FLOPs per token outside the blocks (the head)
    block_saved: tuple[float, ...]         # bytes autograd saves per token in each block
    other_saved: float                     # outside the blocks (embedding output, logits, the loss)
    block_input: float                     # bytes per token of a block's input (what full recompute keeps)
    block_kept: tuple[float, ...]          # bytes per token selective recompute keeps besides the input (torchtitan op policy:
                                           # the input, attention's outputs, every other matmul's output)
    block_attention: tuple[float, ...]     # of block_flops, the attention kernel's (not matmuls: no fp8)
    block_kv: tuple[float, ...]            # bytes per token of the keys and values attention reads
    block_unsplit: tuple[float, ...]       # of block_saved, saved outside the sub-layers (a block's children that
                                           # hold weight matrices: attention, MLP): the norms' (tp leaves them whole
                                           # without sequence parallelism)
    block_gathered: tuple[float, ...]      # bytes per token of the sub-layers' inputs (whole on every tp rank: replicated
                                           # without sequence parallelism, all-gathered with it)
    block_backward: tuple[float, ...]      # bytes per token its backward holds at most beyond what was live when it
                                           # began (its gradients in flight; the weights' gradients left out)
    heads: int = 0                         # attention's query heads (what tp and cp must divide): the attention
                                           # kernel's, else the model's stated; 0: none known
    tied: bool = False                     # the head is the input table (a pipeline's last stage holds a copy)
    experts: int = 0                       # a mixture of experts: the experts per MoE layer (what ep must divide)
    block_experts: tuple[int, ...] = ()    # per block, the parameters of its experts modules (ep's to spread)
    block_expert_flops: tuple[float, ...] = ()  # of block_flops, the experts' (per token, top-k included)
    block_routed: tuple[float, ...] = ()   # bytes per token the dispatch sends to the experts (top-k rows x width)
    block_linears: tuple[int, ...] = ()    # per block, its nn.Linear modules outside the experts (TP cuts each:
                                           # two row-wise, one per sub-layer, the rest column-wise)
    vocab: int = 0                         # the head's outputs per token (the logits' width)
    kv_heads: int = 0                      # key/value heads, where the model names them (tp must divide them)
    logits_f32: float = 0.0                # of other_saved, the float32 copies of the logits the loss saves
                                           # (eager cross-entropy's log-probabilities: 4 bytes x vocab per token)
    block_fp8: tuple[float, ...] = ()      # of block_flops, the Linear layers' mg.Precision("fp8") converts (``fp8=``)
    block_fp8_params: tuple[int, ...] = () # per block, those layers' weights (what FSDP gathers in float8)
    other_fp8: float = 0.0                 # of other_flops, float8's (the head, where it converts)
    fp8: str = ""                          # which layers convert, as mg.Precision("fp8") says it

    @property
    def hidden(self) -> float:
        """The width of what passes between blocks (what TP and PP move per token)."""
        return self.block_input / self.dtype_bytes

    @property
    def layers(self) -> int:
        return len(self.block_params)

    @property
    def params(self) -> int:
        return sum(self.block_params) + self.embed_params + self.head_params + self.other_params

    @property
    def flops_per_token(self) -> float:
        """Training FLOPs per token, torchtitan's convention: 3 x the forward's (no recompute counted)."""
        return 3.0 * (sum(self.block_flops) + self.other_flops)


def count(build, seq_len: int, *, name: str = "", dtype: torch.dtype = torch.bfloat16,
          fp8: tuple[str, tuple[str, ...], tuple[str, ...]] | None = None) -> Counts:
    """Count the model ``build()`` returns (built inside fake mode, so it allocates nothing) on one sequence
    of ``seq_len`` tokens. Its forward takes ``input_ids`` (and ``labels`` where a transformers model has them).
    ``fp8`` (recipe, include, exclude) counts apart the Linear layers ``mg.Precision("fp8", recipe=recipe)``'s
    ``convert(model, include, exclude)`` would turn to float8: the same function chooses them."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    if seq_len < 1:
        raise UsageError(f"--seq-len must be at least 1, got {seq_len}")
    if fp8 is not None:  # torchao imported before fake mode (an import must not make fake tensors)
        from ..parallel import float8
        float8.torchao_float8()
    default = torch.get_default_dtype()
    with FakeTensorMode():
        torch.set_default_dtype(dtype)  # built in the compute dtype (casting fake parameters cannot swap them)
        try:
            model = build()
        except UsageError:
            raise
        except Exception as err:  # the user's builder or a config transformers cannot build
            raise UsageError(f"building {name or 'the model'} failed: {type(err).__name__}: "
                             f"{' '.join(str(err).split())[:200]}") from None
        finally:
            torch.set_default_dtype(default)
        if not isinstance(model, nn.Module):
            raise UsageError(f"{name or 'the builder'} returned a {type(model).__name__}, expected an nn.Module")
        stack = block_stack(model)  # the stack mg.parallel.pipeline cuts
        if stack is None:
            raise UsageError(f"{type(model).__name__} has no repeated blocks (an nn.ModuleList of layers) to cut; "
                             "forecast plans models built as a stack of blocks")
        label, blocks = stack[0], nn.ModuleList(stack[1].children())
        params = {p.untyped_storage()._cdata for p in model.parameters()}
        block_params, block_sharded = [], []
        for block in blocks:
            ps = list(block.parameters())
            block_params.append(sum(p.numel() for p in ps))
            block_sharded.append(sum(p.numel() for p in ps if p.dim() >= 2))
        inside = {id(p) for p in blocks.parameters()}
        tables = {id(p): p for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)}
        embed = sum(p.numel() for i, p in tables.items() if i not in inside)
        out = getattr(model, "get_output_embeddings", lambda: None)()
        outputs = list(out.parameters()) if out is not None else [  # a user's model: linears outside the blocks
            p for m in model.modules() if isinstance(m, nn.Linear) for p in m.parameters(recurse=False) if id(p) not in inside]
        head = sum(p.numel() for p in outputs if id(p) not in tables)  # a head holding the table adds none
        total = sum(p.numel() for p in model.parameters())
        tally, live = _Tally(params, flop_counter()), _Live()
        per_block, inputs = [], []
        from ..parallel.experts import expert_modules

        moe = [m for _, m in expert_modules(model)]
        inside = [{id(m) for m in b.modules()} for b in blocks]
        experts_in = [sum(p.numel() for m in moe if id(m) in ids for p in m.parameters()) for ids in inside]
        in_experts = {id(sub) for m in moe for sub in m.modules()}
        linears = [sum(1 for sub in b.modules() if isinstance(sub, nn.Linear) and id(sub) not in in_experts) for b in blocks]
        kv_heads = head_counts(model).get("KV heads", 0)  # what mg.parallelize checks tp against
        routed, expert_flops = [0.0] * len(blocks), [0.0] * len(blocks)  # per block, of the block running now

        def experts_pre(module, args, kwargs):
            hidden, top_k = (list(args) + list(kwargs.values()))[:2]
            routed[len(per_block) - 1] += top_k.numel() * hidden.shape[-1] * hidden.element_size() / seq_len
            expert_flops[len(per_block) - 1] -= tally.snapshot()[0] / seq_len

        def experts_post(module, args, output):
            expert_flops[len(per_block) - 1] += tally.snapshot()[0] / seq_len

        def pre(module, args, kwargs):
            tally.in_block = True
            x = args[0] if args else next(iter(kwargs.values()))
            inputs.append(x.numel() * x.element_size() / seq_len)
            per_block.append(tally.snapshot())
            tally.matmuls = 0  # torchtitan's policy counts matmuls per block

        def post(module, args, output):
            tally.in_block = False
            per_block[-1] = [b - a for a, b in zip(per_block[-1], tally.snapshot())]
            out = output[0] if isinstance(output, (tuple, list)) else getattr(output, "last_hidden_state", output)
            if isinstance(out, torch.Tensor) and out.requires_grad:  # its gradient's arrival: the block's backward begins
                out.register_hook(functools.partial(live.begin, len(per_block) - 1))

        def enter(module, args, kwargs):
            x = next((a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)), None)
            tally.gathered += 0.0 if x is None else x.numel() * x.element_size()
            tally.depth += 1

        def leave(module, args, output):
            tally.depth -= 1

        sublayers = [m for b in blocks for m in b.children() if any(p.dim() >= 2 for p in m.parameters())]
        handles = [h for b in blocks for h in (b.register_forward_pre_hook(pre, with_kwargs=True),
                                                b.register_forward_hook(post))]
        handles += [h for m in sublayers for h in (m.register_forward_pre_hook(enter, with_kwargs=True),
                                                    m.register_forward_hook(leave))]
        handles += [h for m in moe for h in (m.register_forward_pre_hook(experts_pre, with_kwargs=True),
                                             m.register_forward_hook(experts_post))]
        fp8_flops, fp8_params, fp8_line = [0.0] * (len(blocks) + 1), [0] * (len(blocks) + 1), ""
        if fp8 is not None:  # the FLOPs and weights of the layers float8 converts, per block (the last: the head)
            chosen, left = float8.choose(model, *fp8)
            fp8_line = float8.describe(fp8[0], len(chosen), left)
            block_of = {id(sub): i for i, b in enumerate(blocks) for sub in b.modules()}
            for linear in map(model.get_submodule, chosen):
                at = block_of.get(id(linear), len(blocks))
                fp8_params[at] += linear.weight.numel()
                handles += [linear.register_forward_pre_hook(lambda *_, at=at: tally.add_to(fp8_flops, at, -1 / seq_len)),
                            linear.register_forward_hook(lambda *_, at=at: tally.add_to(fp8_flops, at, 1 / seq_len))]
        ids = torch.zeros(1, seq_len, dtype=torch.long)
        try:
            with tally.flops, tally, live, torch.autograd.graph.saved_tensors_hooks(tally.pack, lambda t: t):
                vocab, loss = _loss(model, ids)
        except Exception as err:  # a forward that needs real values (data-dependent routing) cannot be faked
            raise UsageError(f"counting {name or type(model).__name__} on fake tensors failed: "
                             f"{type(err).__name__}: {' '.join(str(err).split())[:200]} (forecast needs a forward "
                             "whose shapes do not depend on the data: experts run through grouped matmuls, as "
                             "transformers 5 runs them, not a loop over the tokens each expert got)") from None
        try:
            with live:  # the backward, for what each block's holds (``_Live``)
                loss.backward()
        except Exception as err:
            raise UsageError(f"counting {name or type(model).__name__}'s backward on fake tensors failed: "
                             f"{type(err).__name__}: {' '.join(str(err).split())[:200]}") from None
        finally:
            for h in handles:
                h.remove()
    # Tied to the input table (a head module holding it, or a looked-up table read by a matmul after the blocks, as
    # an F.linear head does): a pipeline's last stage holds its copy.
    tied = any(id(p) in tables for p in outputs) or bool(tally.head_operands & tally.lookups)
    if sum(experts_in) != sum(p.numel() for m in moe for p in m.parameters()):
        raise UsageError(f"{name or type(model).__name__}: some of its experts modules lie outside its repeated "
                         "blocks; forecast spreads experts that sit in the blocks")
    if len(per_block) != len(blocks):
        raise UsageError(f"{name}: the forward ran {len(per_block)} of its {len(blocks)} blocks ({label}); "
                         "forecast needs every block run once per forward")
    weights = {p.grad.untyped_storage()._cdata for p in model.parameters() if p.grad is not None}
    n, total_all = seq_len, tally.snapshot()
    col = lambda i: tuple(b[i] / n for b in per_block)  # noqa: E731 - one column of the per-block tallies
    return Counts(name or type(model).__name__, seq_len, torch.finfo(dtype).bits // 8, tuple(block_params),
                  tuple(block_sharded), embed, head, total - sum(block_params) - embed - head,
                  col(0), (total_all[0] - sum(b[0] for b in per_block)) / n,
                  col(1), (total_all[1] - sum(b[1] for b in per_block)) / n,
                  max(inputs), col(2), col(3), col(4), tuple(s - i for s, i in zip(col(1), col(5))), col(6),
                  tuple(b / n for b in live.peaks(len(blocks), weights)),
                  tally.heads or head_counts(model).get("attention heads", 0), tied,
                  min((m.num_experts for m in moe), default=0), tuple(experts_in), tuple(expert_flops), tuple(routed),
                  tuple(linears), vocab, kv_heads, tally.f32_outside[vocab] / n,
                  tuple(fp8_flops[:-1]) if fp8 else (), tuple(fp8_params[:-1]) if fp8 else (), fp8_flops[-1], fp8_line)


def _loss(model: nn.Module, ids: torch.Tensor) -> tuple[int, torch.Tensor]:
    """One forward with its loss: the model's own where its forward takes ``labels`` (transformers), else
    cross-entropy on what it returns; returns the logits' width, the vocabulary (whatever makes them: an
    ``nn.Linear`` head or the token table through ``F.linear``), and the loss. Decided by the signature: a
    TypeError inside the forward must not run it a second time (the block tallies would count twice)."""
    if "labels" in inspect.signature(model.forward).parameters:
        out = model(input_ids=ids, labels=ids, use_cache=False)
        return out.logits.shape[-1], out.loss
    logits = model(ids)
    logits = getattr(logits, "logits", logits)
    loss = nn.functional.cross_entropy(logits.flatten(0, -2).float(), ids.flatten())  # its saved tensors are counted
    return logits.shape[-1], loss


_MATMULS = ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm")
_ATTENTION = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
              "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")


class _Tally(TorchDispatchMode):
    """The running totals the block hooks difference: FLOPs, saved bytes (each storage once, the weights left
    out: they are held anyway), what selective recompute keeps, attention's FLOPs and its K/V bytes, the saved
    bytes inside a sub-layer (``depth``: the sub-layer hooks' nesting) and the sub-layers' input bytes."""

    def __init__(self, params: set, flops) -> None:
        super().__init__()
        self.params, self.seen, self.masks, self.flops = params, set(), set(), flops
        self.saved = self.kept = self.attention = self.kv = self.inner = self.gathered = 0.0
        self.f32_outside: Counter = Counter()  # float32 bytes saved outside the blocks, by last dimension (the
                                               # logits' width: the loss's float32 copy of them)
        self.head_operands: set = set()  # storages the matmuls outside the blocks read (a head through F.linear
                                         # on the token table reads the table's)
        self.lookups: set = set()  # storages embedding lookups read (the input tables)
        self.matmuls = self.heads = self.depth = 0
        self.in_block = False

    def add_to(self, tallies: list[float], at: int, scale: float) -> None:
        """``tallies[at] += scale x`` the FLOPs so far (a module's own, by a pre hook's -1 and a post hook's +1)."""
        tallies[at] += scale * self.flops.get_total_flops()

    def snapshot(self) -> list[float]:
        return [float(self.flops.get_total_flops()), self.saved, self.kept, self.attention, self.kv, self.inner,
                self.gathered]

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage()._cdata
        if key not in self.params and key not in self.masks and key not in self.seen:
            self.seen.add(key)
            self.saved += t.untyped_storage().nbytes()
            self.inner += t.untyped_storage().nbytes() if self.depth else 0.0
            if not self.in_block and t.dtype == torch.float32 and t.dim():
                self.f32_outside[t.shape[-1]] += t.untyped_storage().nbytes()
        return t

    def _drop_mask(self, q: torch.Tensor, k: torch.Tensor, rest) -> None:
        """Leave out the s x s mask the tracing path hands attention: the causal kernel torchtitan and eager
        transformers run (``is_causal``) keeps none, and its bytes per token grow with the sequence. Autograd
        saves an op's inputs before it runs: a mask already counted is taken back."""
        for m in rest:
            if isinstance(m, torch.Tensor) and m.dim() >= 2 and tuple(m.shape[-2:]) == (q.shape[-2], k.shape[-2]):
                key = m.untyped_storage()._cdata
                if key in self.masks:
                    continue
                self.masks.add(key)  # never counted again
                if key in self.seen:  # counted when autograd saved it
                    self.saved -= m.untyped_storage().nbytes()
                    self.inner -= m.untyped_storage().nbytes() if self.depth else 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in _MATMULS:
            self.matmuls += 1
            if not self.in_block:
                self.head_operands.update(a.untyped_storage()._cdata for a in args if isinstance(a, torch.Tensor))
            if self.matmuls % 2:  # torchtitan's op-level policy recomputes every second matmul
                self.kept += out.numel() * out.element_size()
        elif name == "embedding":
            self.lookups.add(args[0].untyped_storage()._cdata)
        elif name in _ATTENTION:
            from torch.utils.flop_counter import sdpa_flop_count

            q, k, v = args[:3]
            self._drop_mask(q, k, list(args[3:]) + list((kwargs or {}).values()))
            self.heads = max(self.heads, q.shape[1])
            self.attention += sdpa_flop_count(q.shape, k.shape, v.shape)
            self.kv += k.numel() * k.element_size() + v.numel() * v.element_size()
            self.kept += sum(o.numel() * o.element_size() for o in out[:2])  # output and log-sum-exp
        return out


class _Live(TorchDispatchMode):
    """The bytes live on the fake device, op by op: every new storage an op makes, until it is freed (a weak
    reference to the storage tells), and the backward's marks where each block's gradient arrives (``begin``).
    ``peaks`` reads, per block, the most its backward held beyond what was live when it began. A storage is
    known by its serial number here: a freed one's address is soon another's."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple] = []  # ("+", serial, bytes), ("-", serial, bytes), ("begin", block)
        self.alive: dict = {}  # storage address -> (serial, weak reference)

    def begin(self, block: int, grad: torch.Tensor) -> None:
        self.log.append(("begin", block))

    def _freed(self, key: int, serial: int, n: int):
        def callback(_) -> None:
            if self.alive.get(key, (None,))[0] == serial:
                del self.alive[key]
            self.log.append(("-", serial, n))
        return callback

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = None
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor) or t.untyped_storage()._cdata in self.alive:
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            # A view or an in-place op hands back its input's storage: nothing new (a weight's transpose is the weight).
            if given is None:
                given = {a.untyped_storage()._cdata for a in _pytree.tree_leaves((args, kwargs))
                         if isinstance(a, torch.Tensor)}
            if key not in given:
                serial = len(self.log)
                self.alive[key] = (serial, weakref.ref(storage, self._freed(key, serial, storage.nbytes())))
                self.log.append(("+", serial, storage.nbytes()))
        return out

    def peaks(self, blocks: int, weights: set) -> list[float]:
        """Per block, the most bytes live during its backward (from its gradient's arrival to the next block's)
        less those live when it began; the weights' gradients (``weights``: their storages' addresses, alive
        now) left out, as the gradients are counted whole elsewhere."""
        skip = {self.alive[key][0] for key in weights if key in self.alive}
        live, peak, at, out = 0, 0, None, [0.0] * blocks
        for event in [*self.log, ("begin", None)]:  # the end closes the last block's window
            if event[0] == "begin":
                if at is not None:
                    out[at[0]] = max(out[at[0]], peak - at[1])
                at, peak = (event[1], live), live
            elif event[1] not in skip:
                live += event[2] if event[0] == "+" else -event[2]
                peak = max(peak, live)
        return out
