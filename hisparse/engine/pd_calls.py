"""The engine façade's prefill/decode calls: a decode engine receives requests whose KV
a prefill engine wrote into its host pool through NIXL (``hisparse.pd``).

:class:`PDCalls` serves the group's ``pd_reserve`` / ``pd_commit`` / ``pd_abort`` over
one ``PDReceiver`` of its cache (made on first use, which starts a NIXL agent and
registers the host pool), and ``pd_connector()``: the object an engine's scheduler
drives, shaped like vLLM's KV-connector scheduler side.

    conn = group.pd_connector()
    params = conn.request_remote_prefill(req_id, num_prompt_tokens)   # bytes, to the prefill engine
    ...                                                               # prefill side: PDSender.send
    ready, failed = conn.get_finished()      # between forwards: committed ids decode from now on,
                                             # failed ids were aborted (blocks in quarantine)
    conn.request_finished(req_id)            # a request dropped before its commit: abort

Like ``add_request`` / ``free_request``, every call here is refused while a forward has
written some layers but not all (a commit writes every layer of its request).
``free_request`` of a reserved request closes its reservation as an abort does (the
receiver listens on the cache's frees): its blocks go into quarantine and the next
``get_finished`` reports it failed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from ..cache.cache import HiSparseCache
    from ..pd.descriptor import PDDescriptor
    from ..pd.receiver import PDReceiver


class PDCalls:
    """The P/D calls over one cache; ``between_forwards(what)`` raises while a forward has
    written some layers but not all (the group's check)."""

    def __init__(self, cache: "HiSparseCache", between_forwards: Callable[[str], None]) -> None:
        self.cache = cache
        self.between_forwards = between_forwards
        self._pd: "PDReceiver | None" = None

    def pd_receiver(self, *, name: str | None = None, backends: tuple[str, ...] = ("UCX",),
                    quarantine_s: float | None = None) -> "PDReceiver":
        """``HiSparseIndexGroup.pd_receiver`` (documented there)."""
        if self._pd is None:
            from ..pd.receiver import QUARANTINE_S, PDReceiver
            self._pd = PDReceiver(self.cache, name=name, backends=backends,
                                  quarantine_s=QUARANTINE_S if quarantine_s is None else quarantine_s)
        return self._pd

    def pd_reserve(self, req_id: int, num_tokens: int, *, timeout_s: float | None = None,
                   salt: bytes | None = None) -> "PDDescriptor":
        """``HiSparseIndexGroup.pd_reserve`` (documented there)."""
        self.between_forwards("pd_reserve")
        return self.pd_receiver().reserve(req_id, num_tokens, timeout_s=timeout_s, salt=salt)

    def pd_commit(self, req_id: int, generation: int) -> None:
        """``HiSparseIndexGroup.pd_commit`` (documented there)."""
        self.between_forwards("pd_commit")
        self.pd_receiver().commit(req_id, generation)

    def pd_abort(self, req_id: int) -> None:
        """``HiSparseIndexGroup.pd_abort`` (documented there)."""
        self.between_forwards("pd_abort")
        self.pd_receiver().abort(req_id)

    def pd_connector(self, *, timeout_s: float | None = 60.0) -> "PDConnector":
        """``HiSparseIndexGroup.pd_connector`` (documented there)."""
        self.pd_receiver()
        return PDConnector(self, timeout_s=timeout_s)


class PDConnector:
    """What a decode engine's scheduler calls (module docstring)."""

    def __init__(self, calls: PDCalls, *, timeout_s: float | None) -> None:
        self.calls = calls
        self.timeout_s = timeout_s

    def request_remote_prefill(self, req_id: int, num_tokens: int) -> bytes:
        """Reserve ``req_id`` for ``num_tokens`` prompt rows; returns the serialised
        descriptor for the prefill engine (``PDDescriptor.from_bytes`` there)."""
        return self.calls.pd_reserve(req_id, num_tokens, timeout_s=self.timeout_s).to_bytes()

    def get_finished(self) -> tuple[list[int], dict[int, str]]:
        """Commit the requests whose transfer completed and abort those that failed or
        passed their deadline: (committed ids, {aborted id: why})."""
        self.calls.between_forwards("get_finished")
        res = self.calls.pd_receiver().poll()
        return list(res.committed), dict(res.failed)

    def request_finished(self, req_id: int) -> bool:
        """A request the scheduler dropped: abort its reservation if it is still open
        (True), else nothing (False; a committed request is freed with free_request)."""
        rx = self.calls.pd_receiver()
        if req_id in rx.open_requests():
            self.calls.pd_abort(req_id)
            return True
        return False

    def pending(self) -> list[int]:
        """Request ids reserved and not committed or aborted yet."""
        return self.calls.pd_receiver().open_requests()


__all__ = ["PDCalls", "PDConnector"]
