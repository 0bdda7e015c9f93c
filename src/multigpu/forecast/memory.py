"""Memory per GPU of one rank of a layout, by part (``forecast.cost``'s docstring says what each part holds)."""

from __future__ import annotations

from .counts import Counts
from .inputs import GiB, Assumptions, Rank


def memory_parts(r: Rank, a: Assumptions) -> dict[str, float]:
    """Bytes per GPU by part (the module's docstring): the states, the buffers, the activations' peak phase, the
    optimizer step's, the allocator's and the runtime's."""
    counts, t, p, m, v, shards, width, held, stored = r.counts, r.t, r.p, r.m, r.v, r.shards, r.width, r.held, r.stored
    on_rank = [(counts.block_params[i] - r.experts[i]) / t + r.experts[i] / r.e for i in range(r.layers)]
    biggest = max(on_rank)  # a block on this rank
    biggest_bytes = max(r.gathered_bytes(i, size) for i, size in enumerate(on_rank))
    memory = {"parameters": 4.0 * stored, "gradients": 4.0 * stored, "optimizer": 8.0 * r.stepped}
    # A pipeline stage keeps its weights gathered and its gradients unsharded in float32 across the
    # micro-batches (PyTorch's pipelining turns FSDP's resharding and gradient sync off until the last).
    # Without a pipeline FSDP's root unit (tables, final norm, head) stays gathered from the forward's first
    # op to the backward's last (FSDP2 does not reshard the root after the forward).
    # Accumulating (m > 1) FSDP skips the reduce-scatter until the last micro-batch (mg.accumulate's sync "last"):
    # every block's unsharded gradient is held meanwhile (float32: FSDP2 accumulates in the reduce dtype); under
    # sync "each" every micro-batch reduce-scatters, as one micro-batch a step does. Otherwise a
    # block's unsharded gradient (in the compute dtype) exists only while its backward runs, beside the block
    # before's reduce-scatter input (its gradient in float32, the reduce dtype), which FSDP2 keeps until the next
    # is made (``reduce_scatter_max_input_buffers``, 1): both belong to a block's backward (``block_grads``, added
    # with that phase below), not to the loss's before it.
    grads = 4.0 * held if r.held_aside else 0.0
    block_grads = (0.0 if r.held_aside else width * biggest) + 4.0 * biggest if shards > 1 and p == 1 else 0.0
    gathered = (4.0 * held + width * (held - r.block_held) + sum(r.gathered_bytes(i, r.dense_of(i)) for i in r.blocks)
                if p > 1 else 2 * biggest_bytes + width * (r.first + r.last) + grads)
    # DDP's reducer keeps a float32 bucket copy of every gradient (PyTorch's default, no gradient_as_bucket_view).
    memory["buffers"] = gathered if shards > 1 else (4.0 * held if r.dp > 1 else 0.0)
    stage_bytes, in_flight, transient, loss_bytes, logits = activation_phases(r)

    def peak(block_phase: float) -> float:  # the larger of a block's backward (on the first stage too) and the loss's
        return max(stage_bytes * in_flight + block_phase, stage_bytes + logits + max(loss_bytes, block_phase))

    phase = transient + block_grads  # a block's backward, FSDP's gradient buffers included
    memory["activations"] = peak(transient)
    memory["buffers"] += peak(phase) - memory["activations"]  # FSDP's, where that phase tops
    # A caching allocator keeps the loss's freed blocks reserved under the block's backward that follows (whose
    # tensors have other sizes): reserved, the two add (torchtitan's peaks; live, on CPU, the larger counts).
    reserved_more = max(0.0, peak(0.0) + phase - peak(phase)) if a.reserved else 0.0
    if p > 1:
        # PyTorch's pipelining allocates a receive buffer per micro-batch at each stage boundary: a stage's input
        # (forward) and its output's gradient (backward); the first stage receives only the one, the last only
        # the other. A rank of 2 stages holds one boundary's buffers; of more, or of several stages, up to two each.
        boundary = counts.block_input * r.tokens / (t if r.sp else 1)
        memory["buffers"] += m * boundary * (1 if p == 2 and v == 1 else 2 * v)
    # The optimizer's step, after the activations are freed: the states, DDP's buckets, and foreach AdamW's
    # float32 temporary of everything it steps (its sqrt of the second moments; ZeRO-1: of its shard); counted where
    # it tops the above.
    at_step = 8.0 * stored + 12.0 * r.stepped + (memory["buffers"] if shards == 1 else 0.0)
    memory["optimizer step"] = max(0.0, at_step - sum(memory.values()))
    memory["allocator"] = a.allocator_overhead * (sum(memory.values()) + reserved_more) + reserved_more
    memory["runtime"] = a.runtime_gib * GiB
    return memory


def activation_phases(r: Rank) -> tuple[float, float, float, float, float]:
    """Bytes of activations: (kept per micro-batch in flight, micro-batches in flight, a block's backward's own while
    it runs, the head's and loss's at the backward's start, the logits a loop holds through the backward)."""
    counts, t, p, run, sp, tokens, blocks = r.counts, r.t, r.p, r.run, r.sp, r.tokens, r.blocks
    recomputed = set(r.recomputed)  # the others keep what they save, as without recompute

    def mode(i: int) -> str:
        return run.recompute if i in recomputed else "none"

    # Sequence parallelism cuts the block input full recompute keeps; without it that stays whole. The logits are
    # cut by vocabulary only under a parallel loss.
    def kept(i: int) -> float:
        if mode(i) == "none":
            return saved_under_tp(counts, i, t, sp)
        block_input = counts.block_input / (t if sp else 1)
        return block_input + counts.block_kept[i] / t if mode(i) == "selective" else block_input

    per_block = [kept(i) for i in blocks]
    stage_bytes = sum(per_block) * tokens  # kept per micro-batch in flight

    # While a block's backward runs, once (a micro-batch's backward at a time): what recompute makes again of its
    # activations (full: all it saved; selective: what the policy did not keep) and its gradients in flight
    # (counted on fake tensors; cut by tp with the matmuls that make them).
    def again(i: int, keep: float) -> float:
        saved = saved_under_tp(counts, i, t, sp)
        return {"none": 0.0, "full": saved, "selective": max(0.0, saved - keep)}[mode(i)]

    # A recomputed block among kept ones (checkpoint_blocks: the first k of a stage) runs its backward after the kept
    # blocks after it have run theirs and freed what they saved: that is not held beside its recomputed activations.
    # Where every block is recomputed or none, nothing is taken off (0): the phase as full or no recompute has it.
    freed, after = [], 0.0
    for i, keep in zip(reversed(blocks), reversed(per_block)):
        freed.append(after if mode(i) != "none" else 0.0)
        after += keep if mode(i) == "none" else 0.0
    transient = max(again(i, keep) + counts.block_backward[i] / t - off
                    for i, keep, off in zip(blocks, per_block, reversed(freed))) * tokens
    in_flight = 1.0 if p == 1 else micro_batches_in_flight(r.layout.schedule, p, r.v, r.m, r.pp_rank)
    # What the head and loss saved, and at the backward's start their gradients of the same size (the logits'
    # float32 and 16-bit gradients). A compiled loss fuses the float32 upcast into its kernels: it saves the 16-bit
    # logits in place of their float32 log-probabilities, and its gradient comes out 16-bit.
    head_saved = counts.other_saved - (counts.logits_f32 * (1 - r.width / 4) if run.compile_loss else 0.0)
    loss_bytes = 2 * head_saved * tokens / (t if run.loss_parallel else 1) if r.holds_last else 0.0
    # The loss's part is freed once the head's backward has run, before the last block's backward: the two come
    # one after the other (the first stage, without the loss, runs a block's backward under its micro-batches in
    # flight).
    logits = counts.vocab * r.width * tokens / (t if run.loss_parallel else 1) if run.logits_held and r.holds_last \
        else 0.0
    return stage_bytes, in_flight, transient, loss_bytes, logits


def micro_batches_in_flight(schedule: str, p: int, v: int, m: int, k: int) -> float:
    """Micro-batches (through all of a rank's stages) whose activations pipeline rank ``k`` of ``p`` holds at its
    peak, as torch's schedules warm up: GPipe all m; 1F1B p - k (``Schedule1F1B``: the last stage 1, each
    before it one more); v stages a rank, (v - 1) x min(m, p) + 2 (p - 1 - k) forwards of one stage
    (``_get_warmup_ops``) and the one the steady state adds, over v stages (rank 0: p (1 + (p-1)/(p v)) when
    m >= p; zbv taken as the loop's). Never more than the step's m (the interleaved warm-up runs every forward
    first when m <= p: measured, 2 ranks x 2 stages, GPT, rank 0's saved activations: m = 2: 2.0 micro-batches,
    m = 4, 8: 2.5)."""
    if schedule == "gpipe":
        return float(m)
    if v == 1:
        return float(min(m, p - k))
    return min(float(m), ((v - 1) * min(m, p) + 2 * (p - 1 - k) + 1) / v)


def saved_under_tp(counts: Counts, i: int, t: int, sequence_parallel: bool) -> float:
    """Bytes per token block ``i`` saves on one of ``t`` tensor-parallel ranks: its one-process bytes cut by t,
    except those every rank holds whole (as counted: ``Counts.block_gathered``, ``block_unsplit``). Each
    sub-layer's input (attention's, the MLP's) is whole on every rank, replicated without sequence parallelism
    and all-gathered with it, and saved by its column-wise linears; without sequence parallelism what the norms
    save outside the sub-layers is whole too."""
    if t == 1:
        return counts.block_saved[i]
    whole = min(counts.block_gathered[i] + (0.0 if sequence_parallel else counts.block_unsplit[i]),
                counts.block_saved[i])
    return (counts.block_saved[i] - whole) / t + whole
