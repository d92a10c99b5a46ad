"""Undo of a resolve whose launch completed but whose call failed afterwards.

A resolve updates the hot tier's LRU state in its first launch and stages the misses
in the next one. When a later launch of the same call raises, the call must leave the
cache as it found it: :func:`rollback_resolve` restores every slot, stamp, row map,
step and counter the resolve changed, from the undo log the resolve wrote into its
``ResolveBuffers`` (``undo_hit``, ``undo_vpos``, ``undo_vstamp``; both the kernel and
the reference write it). It runs only on that failure path, so it may synchronise and
use plain torch ops.

Order of the undo per resolved group (layer l, request slot r, new step s): the misses'
rows are unmapped and each victim gets back its old position, stamp and row map, and,
given the layer's rows, its old bytes (the staging may have overwritten the slot before
the call failed; every hot row's bytes are on host, so they are copied back from there);
then every hit slot whose stamp this step changed gets its old stamp; then step[l, r]
and the counters go back.
"""

from __future__ import annotations

import torch

from .resolve_ref import host_rows_of_keys, resident_rows, resolve_groups
from .state import STAT_HITS, STAT_INVALID, STAT_MISSES, STAT_RESIDENT, STAT_RESOLVES, HotState, ResolveBuffers


def rollback_resolve(state: HotState, layer: int, req_ids: torch.Tensor, topk: torch.Tensor,
                     out: ResolveBuffers, *, max_query_len: int, miss_phase_ran: bool = True,
                     hot_rows: torch.Tensor | None = None, host_rows: torch.Tensor | None = None) -> None:
    """Restore ``state`` of ``layer`` to what it was before the resolve that wrote ``out``.

    req_ids: int32 [T] and topk: int32 [T, K], the resolve's inputs; out: its buffers
    (views of capacity [T, K]). The resolve's launches must have completed (the caller
    synchronises first). ``miss_phase_ran=False``: only the hit phase of a split
    resolve ran (hits stamped with step + 1 and counted, nothing mapped).
    hot_rows: uint8 [N, row_bytes] and host_rows: uint8 [H, row_bytes], the layer's:
    victims' bytes are restored from host (needed once the staging may have run), read
    at the host rows of their row keys (``state.host_block``).
    """
    T, K = topk.shape
    if T == 0:
        return
    if not miss_phase_ran:
        _rollback_hit_phase(state, layer, req_ids, topk, out, max_query_len)
        return
    S, B = state.S, state.B
    SP = S + 1
    row_slot = state.row_slot[layer]
    slot_pos = state.slot_pos[layer]
    slot_stamp = state.slot_stamp[layer]
    hits = misses = resident = 0
    _rslot, _off, _ok, groups = resolve_groups(state, layer, req_ids, topk, max_query_len)
    for t0, r, n in groups:
        if int(state.resident[r]):  # a resident group changed only counters
            resident += int(out.valid_counts[t0:t0 + n].sum())
            continue
        s_new = int(state.step[layer, r])
        base = t0 * K
        bt = state.block_table[r].long()
        dst = out.stage_dst[base:base + n * K].long()
        m = int((dst >= 0).sum())
        if m:
            slots = dst[:m] - r * SP
            new_pos = slot_pos[r, slots].long()  # the misses the resolve mapped (stage_src holds host rows)
            row_slot[bt[new_pos // B] * B + new_pos % B] = -1
            old_pos = out.undo_vpos[base:base + m]
            slot_pos[r, slots] = old_pos
            slot_stamp[r, slots] = out.undo_vstamp[base:base + m]
            had = old_pos >= 0
            op = old_pos[had].long()
            old_rows = bt[op // B] * B + op % B
            row_slot[old_rows] = slots[had].to(torch.int32)
            if hot_rows is not None and bool(had.any()):
                back = host_rows[host_rows_of_keys(old_rows, state.host_block, B).to(host_rows.device)]
                hot_rows[dst[:m][had].to(hot_rows.device)] = back.to(hot_rows.device)
        undo = out.undo_hit[base:base + n * K]
        lanes = (undo >= 0) & (undo != s_new)
        if bool(lanes.any()):
            pos = topk[t0:t0 + n].reshape(-1)[lanes].long()
            hs = row_slot[bt[pos // B] * B + pos % B].long()
            slot_stamp[r, hs] = undo[lanes]
        hits += int(lanes.sum())
        misses += m
        state.step[layer, r] = s_new - 1
    entries = int((topk != -1).sum())
    valid = int(out.valid_counts[:T].sum())
    st = state.stats[layer]
    st[STAT_HITS] -= hits
    st[STAT_MISSES] -= misses
    st[STAT_RESIDENT] -= resident
    st[STAT_INVALID] -= entries - valid
    st[STAT_RESOLVES] -= len(groups)


def _rollback_hit_phase(state: HotState, layer: int, req_ids: torch.Tensor, topk: torch.Tensor,
                        out: ResolveBuffers, max_query_len: int) -> None:
    """Undo ``resolve_lookup_*``: the hit stamps and the hit and invalid counts."""
    _rslot, _off, ok, groups = resolve_groups(state, layer, req_ids, topk, max_query_len)
    K, B = topk.shape[1], state.B
    hits = bad = resident = 0
    for t0, r, n in groups:
        if int(state.resident[r]):  # a resident group changed only counters
            g = topk[t0:t0 + n].long()
            rows = resident_rows(state, r, g, ok[t0:t0 + n])
            resident += int((rows >= 0).sum())
            bad += int(((g != -1) & (rows < 0)).sum())
            continue
        s_new = int(state.step[layer, r]) + 1
        undo = out.undo_hit[t0 * K:(t0 + n) * K]
        lanes = (undo >= 0) & (undo != s_new)
        if bool(lanes.any()):
            pos = topk[t0:t0 + n].reshape(-1)[lanes].long()
            bt = state.block_table[r].long()
            hs = state.row_slot[layer][bt[pos // B] * B + pos % B].long()
            state.slot_stamp[layer, r, hs] = undo[lanes]
        hits += int(lanes.sum())
        g = topk[t0:t0 + n].long()
        bad += int(((g != -1) & ~ok[t0:t0 + n]).sum())
    state.stats[layer, STAT_HITS] -= hits
    state.stats[layer, STAT_RESIDENT] -= resident
    state.stats[layer, STAT_INVALID] -= bad


__all__ = ["rollback_resolve"]
