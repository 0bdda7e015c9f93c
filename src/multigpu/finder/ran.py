"""What size a trial's step ran: the finder's check that ``step_fn(n)`` ran n, not fewer.

A step that slices its data (``x[:m]``, ``tokens[:, :n]``) runs fewer samples or tokens than asked once
the data is shorter (Python's slices stop at the end without a word), and then "fits" any size asked:
the search reported 65,536 tokens for a step that ran 2,048. Two witnesses:

- the modules' inputs, every trial (a global forward pre-hook, removed when the trial ends), each extent
  keyed by (module, its k-th call in the trial, argument, dimension): the positions that held the asked
  size in two trials of different sizes are the step's axis (the batch dimension, the sequence dimension,
  wherever the model carries it); a trial where none of them holds the asked size and all hold less ran
  fewer. At the second size, positions that held the first and moved, but short of the second, ran fewer;
  inputs all as they were at the first size ran the first size's data again.
- the slices, in the unmeasured first trial: a ``tensor[...]`` whose slice asks at least the size along a
  dimension and runs past its end (a TorchFunctionMode sees every ``Tensor.__getitem__``): data shorter
  than ``start``.

A step that shows neither (no module, inputs that carry the size in another shape: context parallelism's
cut share, a flat packing) is left to itself: no verdict from evidence that does not show the size.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.overrides import TorchFunctionMode


class _Slices(TorchFunctionMode):
    """Records the largest run-short slice of a trial: (what it yielded, what it asked), asked >= ``size``."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size, self.cut = size, None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__getitem__ and len(args) == 2 and isinstance(args[0], torch.Tensor):
            self._look(args[0].shape, args[1] if isinstance(args[1], tuple) else (args[1],))
        return func(*args, **(kwargs or {}))

    def _look(self, shape: torch.Size, index: tuple) -> None:
        if any(i is Ellipsis for i in index):  # the dims after ... count from the end
            at = index.index(Ellipsis)
            after = sum(1 for i in index[at + 1:] if i is not None)
            self._walk(shape, index[:at], 0)
            self._walk(shape, index[at + 1:], len(shape) - after)
        else:
            self._walk(shape, index, 0)

    def _walk(self, shape: torch.Size, index: tuple, dim: int) -> None:
        for i in index:
            if i is None:
                continue
            if not isinstance(i, (int, slice)) or dim >= len(shape):
                return  # advanced indexing: no reading of which dims it takes
            if isinstance(i, slice) and i.step in (None, 1) and isinstance(i.stop, int) and i.stop >= 0 \
                    and (i.start is None or isinstance(i.start, int) and i.start >= 0):
                start = i.start or 0
                asked, extent = i.stop - start, int(shape[dim])
                if asked >= self.size and i.stop > extent and (self.cut is None or asked > self.cut[1]):
                    self.cut = (max(0, extent - start), asked)
            dim += 1


class Watch:
    """The steps of a search, one trial at a time (``trial``), and ``short``: did the last run fewer?"""

    def __init__(self) -> None:
        self.first: tuple[int, set[tuple], dict] | None = None  # (size, positions that held it, all extents)
        self.axes: set[tuple] | None = None  # positions that held the size in trials of two sizes
        self.seen: dict[tuple, int] = {}
        self.cut: tuple[int, int] | None = None

    @contextlib.contextmanager
    def trial(self, size: int, slices: bool) -> Iterator[None]:
        """Watch one trial of ``size``; ``slices``: its slices too (the unmeasured first trial only: a
        TorchFunctionMode routes every torch call of the step through Python, and can change how
        torch.compile traces it, so the measured trials run the step as training will, hooks aside)."""
        seen: dict[tuple, int] = {}
        calls: dict[int, int] = {}

        def hook(module: Any, args: tuple) -> None:
            k = calls[id(module)] = calls.get(id(module), -1) + 1
            for j, t in enumerate(a for a in args if isinstance(a, torch.Tensor)):
                for d, extent in enumerate(t.shape):
                    seen[(id(module), k, j, d)] = int(extent)

        handle = register_module_forward_pre_hook(hook)  # reads shapes only: the peak is the step's own
        mode = _Slices(size) if slices else None
        try:
            with mode if mode is not None else contextlib.nullcontext():
                yield
        finally:
            handle.remove()
            self.seen, self.cut = seen, None if mode is None else mode.cut

    def short(self, asked: int) -> tuple[int, bool] | None:
        """After a trial of ``asked``: (the size it ran, exact) where that was less than asked, else None; not
        exact: it ran the same inputs as the first size did, which the data holds at most."""
        if self.cut is not None:
            return self.cut[0], True
        seen = self.seen
        holding = {k for k, v in seen.items() if v == asked}
        if self.axes is None:
            if self.first is None or self.first[0] == asked:
                self.first = (asked, holding if self.first is None else self.first[1] & holding, seen)
                return None
            size, held, before = self.first
            # A second size: what held both is the axis (a constant extent cannot equal two sizes).
            self.axes = held & holding
            if self.axes or not seen:
                return None
            moved = [seen[k] for k in held if k in seen and seen[k] != size]
            if moved and all(v < asked for v in moved):
                return max(moved), True  # it followed the size, short of this one
            if seen == before and size < asked:
                return size, False  # the same inputs as step_fn(size): the data ended there, or before
            return None
        if self.axes & holding:
            self.axes &= holding
            return None
        held = [seen[k] for k in self.axes if k in seen]
        if held and all(v < asked for v in held):
            return max(held), True
        return None
