"""The prefill side of a prefill/decode transfer: ``PDSender``.

It needs no cache: given a decode side's ``PDDescriptor`` and the request's rows of
every layer (uint8 [C, row_bytes] each, CPU or CUDA), ``send`` checks them against the
descriptor and the sender's own layout (row format, block size), reads the
reservation's generation word from the decode side (a NIXL READ of 8 bytes: a
reservation closed since the descriptor was made refuses the send before any byte
moves), registers the rows, posts the WRITEs (one transfer of every layer's regions,
or one per layer), waits for them and returns a ``SendReport``. The decode side learns
of the completion from the notice attached to the (last) transfer; a transfer that
fails or times out sends a "fail" notice instead and raises ``TransferError``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import numpy as np
import torch

from .._checks import check_int
from .descriptor import PDDescriptor, notice
from .errors import StaleDescriptorError, TransferError
from .nixl_api import make_agent


@dataclasses.dataclass(frozen=True)
class SendReport:
    request_id: int
    bytes: int           # bytes written (L x C x row_bytes)
    seconds: float       # from the first post to the last completion
    transfers: int       # NIXL transfers posted
    descriptors: int     # memory regions written

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


class PDSender:
    """The prefill side (module docstring). ``row_format`` / ``block_size``: the layout
    this prefill engine produces; a descriptor of another is refused."""

    def __init__(self, *, row_format: str, block_size: int, name: str = "hisparse-prefill",
                 backends: tuple[str, ...] = ("UCX",)) -> None:
        if not isinstance(row_format, str):
            raise TypeError(f"row_format must be a str, got {type(row_format).__name__}")
        self.row_format = row_format
        self.block_size = check_int("block_size", block_size, 1)
        self.name = name
        self._agent = make_agent(name, tuple(backends), progress_thread=False)
        self._peers: dict[str, bytes] = {}  # remote agent name -> the metadata loaded for it
        self._word = np.zeros(1, dtype=np.int64)  # the generation word read back
        self._word_reg = self._agent.register_memory([(self._word.ctypes.data, 8, 0, "")], "DRAM")

    def check(self, desc: PDDescriptor, rows: Sequence[torch.Tensor]) -> None:
        """The checks ``send`` makes before it moves anything (TypeError, ValueError)."""
        if not isinstance(desc, PDDescriptor):
            raise TypeError(f"desc must be a PDDescriptor, got {type(desc).__name__}")
        if desc.row_format != self.row_format:
            raise ValueError(f"request {desc.request_id}: the decode side stores {desc.row_format!r} rows, this "
                             f"sender produces {self.row_format!r}")
        if desc.block_size != self.block_size:
            raise ValueError(f"request {desc.request_id}: the decode side's block size is {desc.block_size} "
                             f"tokens, this sender's {self.block_size}")
        if not isinstance(rows, (list, tuple)) or len(rows) != desc.num_layers:
            raise ValueError(f"rows must be a list of {desc.num_layers} tensors (one per layer), got "
                             f"{type(rows).__name__} of {len(rows) if isinstance(rows, (list, tuple)) else '?'}")
        want = (desc.num_tokens, desc.row_bytes)
        for i, t in enumerate(rows):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or tuple(t.shape) != want:
                got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"rows[{i}] must be uint8 {list(want)} (C x row_bytes), got {got}")
            if not t.is_contiguous():
                raise ValueError(f"rows[{i}] must be contiguous (NIXL writes byte ranges)")
            if t.device != rows[0].device:
                raise ValueError(f"rows[{i}] is on {t.device}, rows[0] on {rows[0].device}: one device for all")

    def send(self, desc: PDDescriptor, rows: Sequence[torch.Tensor], *, per_layer: bool = False,
             timeout_s: float = 30.0) -> SendReport:
        """Write ``rows`` (per layer uint8 [C, row_bytes], contiguous, one device) into the
        reserved blocks and notify the decode side (module docstring)."""
        self.check(desc, rows)
        peer = self._peer(desc)
        self._check_generation(desc, peer)
        if rows[0].is_cuda:
            torch.cuda.current_stream(rows[0].device).synchronize()  # rows written by the stream are complete
        reg = self._agent.register_memory(list(rows))
        try:
            return self._write(desc, rows, peer, per_layer, timeout_s)
        finally:
            self._agent.deregister_memory(reg)

    # ---- helpers --------------------------------------------------------------------
    def _peer(self, desc: PDDescriptor) -> str:
        if self._peers.get(desc.agent_name) != desc.agent_metadata:
            if desc.agent_name in self._peers:  # the decode agent restarted: new metadata
                self._agent.remove_remote_agent(desc.agent_name)
            name = self._agent.add_remote_agent(desc.agent_metadata)
            name = name.decode() if isinstance(name, bytes) else name
            if name != desc.agent_name:
                raise ValueError(f"the descriptor's metadata is agent {name!r}, its agent_name {desc.agent_name!r}")
            self._peers[desc.agent_name] = desc.agent_metadata
        return desc.agent_name

    def _wait(self, handles: list, timeout_s: float, what: str) -> None:
        end = time.monotonic() + timeout_s
        for h in handles:
            while True:
                state = self._agent.check_xfer_state(h)
                if state == "DONE":
                    break
                if state == "ERR":
                    raise TransferError(f"NIXL reported an error on {what}")
                if time.monotonic() > end:
                    raise TransferError(f"{what} did not complete in {timeout_s} s")

    def _check_generation(self, desc: PDDescriptor, peer: str) -> None:
        self._word[0] = -1
        local = self._agent.get_xfer_descs([(self._word.ctypes.data, 8, 0)], "DRAM")
        remote = self._agent.get_xfer_descs([(desc.generation_addr, 8, 0)], "DRAM")
        h = self._agent.initialize_xfer("READ", local, remote, peer)
        try:
            if self._agent.transfer(h) == "ERR":
                raise TransferError(f"request {desc.request_id}: reading the generation word failed")
            self._wait([h], 10.0, f"request {desc.request_id}'s generation read")
        finally:
            self._agent.release_xfer_handle(h)
        if int(self._word[0]) != desc.generation:
            raise StaleDescriptorError(f"request {desc.request_id}: the descriptor's generation {desc.generation} "
                                       f"is not the decode side's open one ({int(self._word[0])}; 0 = closed): "
                                       "its reservation was committed or aborted; nothing was written")

    def _write(self, desc: PDDescriptor, rows: Sequence[torch.Tensor], peer: str, per_layer: bool,
               timeout_s: float) -> SendReport:
        rb = desc.row_bytes
        dev = rows[0].get_device() if rows[0].is_cuda else 0
        mem = "VRAM" if rows[0].is_cuda else "DRAM"
        groups = []  # (local Nx3, remote Nx3) per transfer
        for layer, t in enumerate(rows):
            regions = desc.layer_regions(layer)
            base = t.data_ptr()
            local = np.array([(base + a * rb, n, dev) for _addr, n, a, _b in regions], dtype=np.uint64)
            remote = np.array([(addr, n, 0) for addr, n, _a, _b in regions], dtype=np.uint64)
            groups.append((local, remote))
        if not per_layer:
            groups = [(np.concatenate([g[0] for g in groups]), np.concatenate([g[1] for g in groups]))]
        done = notice("done", request_id=desc.request_id, generation=desc.generation, row_format=self.row_format,
                      row_bytes=rb, block_size=self.block_size, bytes=desc.nbytes)
        handles = []
        t0 = time.perf_counter()
        try:
            for i, (local, remote) in enumerate(groups):
                ld = self._agent.get_xfer_descs(local, mem)
                rd = self._agent.get_xfer_descs(remote, "DRAM")
                # one transfer carries the notice: when it is the only one, NIXL delivers it after the data
                h = self._agent.initialize_xfer("WRITE", ld, rd, peer, done if len(groups) == 1 else b"")
                handles.append(h)
                if self._agent.transfer(h) == "ERR":
                    raise TransferError(f"request {desc.request_id}: NIXL refused to post transfer {i}")
            self._wait(handles, timeout_s, f"request {desc.request_id}'s transfer")
            seconds = time.perf_counter() - t0
            if len(groups) > 1:
                self._agent.send_notif(peer, done)  # after every layer completed
        except BaseException as e:
            try:
                self._agent.send_notif(peer, notice("fail", request_id=desc.request_id,
                                                    generation=desc.generation, reason=str(e)))
            finally:
                for h in handles:
                    self._agent.release_xfer_handle(h)
            raise
        for h in handles:
            self._agent.release_xfer_handle(h)
        return SendReport(request_id=desc.request_id, bytes=desc.nbytes, seconds=seconds,
                          transfers=len(groups), descriptors=sum(len(g[0]) for g in groups))

    def close(self) -> None:
        self._agent.deregister_memory(self._word_reg)


__all__ = ["PDSender", "SendReport"]
