"""The prefill side of a prefill/decode transfer: ``PDSender``.

It needs no cache: given a decode side's ``PDDescriptor`` and the request's rows of
every layer (uint8 [C, row_bytes] each, CPU or CUDA), ``send`` checks them against the
descriptor and the sender's own layout (row format, block size), reads the
reservation's generation word from the decode side (a NIXL READ of 8 bytes, at most
``read_timeout_s``: a reservation closed since the descriptor was made refuses the send
before any byte moves), registers the rows, posts the WRITEs (one transfer of every
layer's regions, or one per layer), waits for them (at most ``timeout_s``) and returns
a ``SendReport``. The decode side learns of the completion from the notice attached to
the (last) transfer.

A send that fails after the generation read (registering the rows, posting, an error or
the timeout) first releases every transfer handle it posted (NIXL cancels a transfer
still running), then sends a "fail" notice and raises ``TransferError``. When a handle
can't be released (the transfer could not be cancelled) the notice says ``in_flight``
(the decode side then holds the blocks until its quarantine time is up) and the rows
stay registered (a WRITE may still read them) until ``close``. The decode side's
``quarantine_s`` must exceed ``read_timeout_s`` plus ``timeout_s`` (receiver module).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import numpy as np
import torch

from .._checks import check_int
from .descriptor import PDDescriptor, notice
from .errors import PDError, StaleDescriptorError, TransferError
from .nixl_api import cuda_mismatch, default_agent_name, make_agent


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

    def __init__(self, *, row_format: str, block_size: int, name: str | None = None,
                 backends: tuple[str, ...] = ("UCX",), read_timeout_s: float = 10.0) -> None:
        if not isinstance(row_format, str):
            raise TypeError(f"row_format must be a str, got {type(row_format).__name__}")
        if not (isinstance(read_timeout_s, (int, float)) and read_timeout_s > 0):
            raise ValueError(f"read_timeout_s must be a positive number of seconds, got {read_timeout_s!r}")
        self.row_format = row_format
        self.block_size = check_int("block_size", block_size, 1)
        self.read_timeout_s = float(read_timeout_s)
        self.name = default_agent_name("prefill") if name is None else name
        self._agent = make_agent(self.name, tuple(backends), progress_thread=False)
        self._peers: dict[str, bytes] = {}  # remote agent name -> the metadata loaded for it
        self._word = np.zeros(1, dtype=np.int64)  # the generation word read back
        self._word_reg = self._agent.register_memory([(self._word.ctypes.data, 8, 0, "")], "DRAM")
        self._held: list = []  # registrations a transfer that could not be cancelled may still read

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
        if self._agent is None:
            raise PDError(f"send: the sender {self.name!r} is closed")
        self.check(desc, rows)
        peer = self._peer(desc)
        self._check_generation(desc, peer)
        if rows[0].is_cuda:
            torch.cuda.current_stream(rows[0].device).synchronize()  # rows written by the stream are complete
        try:
            reg = self._agent.register_memory(list(rows))
        except Exception as e:
            self._fail(peer, desc, e, in_flight=False)
            hint = cuda_mismatch() if rows[0].is_cuda else None
            raise TransferError(f"request {desc.request_id}: registering the rows failed ({type(e).__name__}: "
                                f"{e}){'; ' + hint if hint else ''}; a fail notice was sent") from e
        try:
            report = self._write(desc, rows, peer, per_layer, timeout_s)
        except _InFlight as e:
            self._held.append(reg)  # a WRITE may still read the rows: deregistered by close
            raise e.error from None
        except BaseException as e:
            try:
                self._agent.deregister_memory(reg)
            except Exception as e2:
                e.add_note(f"deregistering the rows failed too: {type(e2).__name__}: {e2}")
            raise
        self._agent.deregister_memory(reg)
        return report

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
        """Until every handle is DONE: polls back to back at first, then sleeps between
        polls (10 us, doubling up to 1 ms). TransferError on an error or the timeout."""
        end = time.monotonic() + timeout_s
        polls, nap = 0, 1e-5
        for h in handles:
            while True:
                state = self._agent.check_xfer_state(h)
                if state == "DONE":
                    break
                if state == "ERR":
                    raise TransferError(f"NIXL reported an error on {what}")
                if time.monotonic() > end:
                    raise TransferError(f"{what} did not complete in {timeout_s} s")
                polls += 1
                if polls > 64:
                    time.sleep(nap)
                    nap = min(nap * 2, 1e-3)

    def _release(self, handles: list) -> list[str]:
        """Release every handle (NIXL cancels a running transfer); the errors, one each."""
        errors = []
        for h in handles:
            try:
                self._agent.release_xfer_handle(h)
            except Exception as e:
                errors.append(f"{type(e).__name__}: {e}")
        return errors

    def _fail(self, peer: str, desc: PDDescriptor, error: BaseException, *, in_flight: bool) -> None:
        """Send the "fail" notice of ``error``; a failure to send it becomes a note on ``error``."""
        try:
            self._agent.send_notif(peer, notice("fail", request_id=desc.request_id, generation=desc.generation,
                                                reason=f"{type(error).__name__}: {error}", in_flight=in_flight))
        except Exception as e:
            error.add_note(f"the fail notice could not be sent either: {type(e).__name__}: {e}")

    def _check_generation(self, desc: PDDescriptor, peer: str) -> None:
        self._word[0] = -1
        local = self._agent.get_xfer_descs([(self._word.ctypes.data, 8, 0)], "DRAM")
        remote = self._agent.get_xfer_descs([(desc.generation_addr, 8, 0)], "DRAM")
        h = self._agent.initialize_xfer("READ", local, remote, peer)
        try:
            if self._agent.transfer(h) == "ERR":
                raise TransferError(f"request {desc.request_id}: reading the generation word failed")
            self._wait([h], self.read_timeout_s, f"request {desc.request_id}'s generation read")
        except BaseException as e:
            for err in self._release([h]):
                e.add_note(f"releasing the read's handle failed too: {err}")
            raise
        errors = self._release([h])
        if errors:
            raise TransferError(f"request {desc.request_id}: releasing the generation read's handle failed: "
                                f"{errors[0]}; nothing was written")
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
            errors = self._release(handles)  # cancels what still runs, before the notice
            for err in errors:
                e.add_note(f"a transfer handle could not be released (its WRITE may still run): {err}")
            self._fail(peer, desc, e, in_flight=bool(errors))
            if errors:
                raise _InFlight(e) from None
            raise
        errors = self._release(handles)
        if errors:
            raise PDError(f"request {desc.request_id}: the transfer completed and its done notice went out, but "
                          f"releasing {len(errors)} handle(s) failed: {errors[0]}")
        return SendReport(request_id=desc.request_id, bytes=desc.nbytes, seconds=seconds,
                          transfers=len(groups), descriptors=sum(len(g[0]) for g in groups))

    def close(self) -> None:
        """Deregister the memory and drop the agent. Idempotent."""
        if self._agent is None:
            return
        try:
            for reg in [self._word_reg, *self._held]:
                self._agent.deregister_memory(reg)
        finally:
            self._held = []
            self._agent = None


class _InFlight(Exception):
    """``_write``'s error when a handle could not be released (``send`` keeps the rows
    registered); ``error`` is the original one."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


__all__ = ["PDSender", "SendReport"]
