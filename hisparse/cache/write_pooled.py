"""The write of a ``host_written`` step from the host pool: every pending layer at once.

A ``host_written`` step (``Writer.prepare_step(..., host_written=True)``) appends rows
that are in the host pool already: a P/D transfer wrote them (``hisparse.pd``). Its
per-layer ``write_step`` takes the rows as a device tensor, so a caller would gather
them from the pool once per layer and pay a write's host work per layer (61 of them for
one request's commit). :func:`write_pooled` instead applies the step to every layer it
has pending in one launch of ``apply_write_layers_kernel`` (Triton: the pool read over
UVA) or the torch reference, reading each hot row straight from the pool. For that
the step carries a second plan, its *pooled plan*: the same lists with each ``hot_tok``
entry (a token of the batch's rows) replaced by the host row that holds it
(:func:`host_written_plans`, made with the step's own plan in one copy).

The state it leaves is the one ``write_step`` of every pending layer leaves with the
same rows. A host_written step opens no block (its rows' blocks hold them already), so
the host row of each token is known when the step is prepared.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .write_plan import _NAMES, PlanLayout, WritePlan, to_device

if TYPE_CHECKING:
    from .write import Writer
    from .write_step import StepPlan, StepWork

_HOT_TOK = _NAMES.index("hot_tok")


def host_written_plans(writer: "Writer", packed: np.ndarray, layout: PlanLayout, lists: list[np.ndarray],
                       work: "StepWork", t0: np.ndarray) -> tuple[WritePlan, WritePlan]:
    """(the step's plan, its pooled plan) on the writer's device, one copy for both.
    packed: int64 [layout.words], the packed ``lists`` (15 int64 numpy lists, ``_NAMES``
    order, no block-table entries); work: the step's requests (those that write); t0:
    int64 [n], each one's first token in the batch's rows. The pooled plan is the same
    buffer with each hot_tok entry replaced by the host row that holds the token."""
    tok = lists[_HOT_TOK]  # int64 [n_hot]: token of the batch's rows
    both = np.concatenate([packed, packed])
    if len(tok):
        B = writer.pool.B
        i = np.searchsorted(t0, tok, side="right") - 1  # the request each token belongs to
        pos = work.p0[i] + (tok - t0[i])  # its position
        blk = writer.host_blocks[work.slot[i], pos // B].astype(np.int64)
        if (blk < 0).any():
            raise RuntimeError("a host_written step's token lies in a block its request does not hold")
        o = layout.words + layout.o64[_HOT_TOK]
        both[o:o + len(tok)] = writer.pool.allocator.host_of[blk] * B + pos % B
    dev = to_device(both, writer.device)
    return WritePlan(dev[:layout.words], layout), WritePlan(dev[layout.words:], layout)


def check_host_written(work: "StepWork", num_blocks: np.ndarray, B: int) -> None:
    """ValueError when a ``host_written`` step would open blocks (its rows are in the
    pool, so their blocks must be held already). work: the step's requests;
    num_blocks: int64 [R], the blocks each request slot holds; B: rows per block."""
    need = -(-work.p1 // B) - num_blocks[work.slot]  # int64 [n]
    if (need > 0).any():
        i = int(need.argmax())
        raise ValueError(f"host_written: request {int(work.rid[i])} holds too few blocks for the step's rows "
                         f"({int(need[i])} more needed); rows in the host pool lie in blocks the request "
                         "holds (allocate them first, as PDReceiver.reserve does)")


def write_pooled(writer: "Writer", step: "StepPlan") -> None:
    """Apply ``step`` (host_written) to every layer it has pending, the rows read from
    the host pool: one launch per run of consecutive pending layers (one run unless a
    layer was written alone before). The checks of ``write_step`` come first (nothing
    changed when they fail); a launch that raises leaves its layers pending."""
    if not step.host_written:
        raise ValueError("write_pooled takes a step prepared with host_written=True (its rows in the "
                         "host pool)")
    layers = sorted(step.pending)
    writer.check_step(layers[0] if layers else 0, step)  # (every layer written: "already written")
    if not layers or step.pooled is None:  # (a step of zero rows has nothing pending)
        return
    cs = writer.streams
    cur, cap = cs.current(), cs.capturing()
    for layer in layers:  # as before_write: the layer's in-flight resolve state updates first
        cs.wait_resolved(layer, cur)
    if step.pooled.counts[3]:  # unmap entries: the old occupants must be on host first
        cs.backup.wait_by(cur, cap)
    runs: list[range] = []
    for layer in layers:
        if runs and runs[-1].stop == layer:
            runs[-1] = range(runs[-1].start, layer + 1)
        else:
            runs.append(range(layer, layer + 1))
    for run in runs:
        writer.kernel_set.apply_write_pooled(writer.state, writer.hot, writer.pool.rows, step.pooled, run,
                                             step.host_rows)
        writer._finish_step(run, step, capturing=cap)


__all__ = ["host_written_plans", "check_host_written", "write_pooled"]
