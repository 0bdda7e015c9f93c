"""The dispatch modes that watch ``counts.count``'s fake forward and backward, op by op: ``Tally`` keeps the
running totals its block hooks difference (FLOPs, saved bytes, attention's), ``Live`` the bytes live on the fake
device, for what each block's backward holds."""

from __future__ import annotations

import weakref
from collections import Counter

import torch
from torch.utils import _pytree
from torch.utils._python_dispatch import TorchDispatchMode


_MATMULS = ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm")
_ATTENTION = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
              "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")


class Tally(TorchDispatchMode):
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


class Live(TorchDispatchMode):
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
