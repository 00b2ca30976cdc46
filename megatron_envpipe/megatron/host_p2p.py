"""Point-to-point tensors staged through host memory: a transport, never the math.

``--p2p-transport host`` lets a pipeline whose ranks share one GPU run over
gloo (NCCL refuses two ranks on one device), and gloo cannot send, receive or
all-gather CUDA tensors. :func:`host_p2p` patches the ``torch.distributed``
functions Megatron's ``p2p_communication`` and EnvPipe's own channels call
(``isend``/``irecv``/``send``/``recv``, ``P2POp`` + ``batch_isend_irecv``, and
the collectives ``all_gather``/``all_gather_into_tensor``/``all_reduce``/
``broadcast``) so that every tensor crosses gloo as a host copy:

* a send copies the tensor to a (pinned, on CUDA) host buffer when it is
  posted, so the caller may free or overwrite it at once, and sends the copy;
* a receive lands in a host buffer and is copied into the caller's tensor when
  the work is waited on, or when ``is_completed()`` first says True, so the
  tensor is valid exactly when torch's own work object would say it is.

The copies are bit-exact, so losses do not change; the same code runs on CPU
tensors (real host copies there too), which is how CI exercises it. Applied
identically to the stock (``--no-envpipe``) run and to EnvPipe's: it is the
wire, not a schedule. Everything patched is restored on exit.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_envpipe.megatron.compat import ShimHandle

__all__ = ["StagingCounts", "current_counts", "host_p2p"]

# The names patched on ``torch.distributed``, restored in reverse order on exit.
_PATCHED = ("isend", "irecv", "send", "recv", "P2POp", "batch_isend_irecv",
            "all_gather", "all_gather_into_tensor", "all_reduce", "broadcast")


@dataclass
class StagingCounts:
    """What went through the host in this process while the transport was active."""

    sends: int = 0          # point-to-point messages sent from a host copy
    recvs: int = 0          # point-to-point messages received into a host buffer and copied out
    collectives: int = 0    # all-gather / all-reduce / broadcast calls staged
    bytes_staged: int = 0   # payload bytes copied to or from the host, P2P and collectives

    @property
    def p2p_messages(self) -> int:
        return self.sends + self.recvs


_ACTIVE: list[StagingCounts] = []  # the counts of the active (innermost) transport


def current_counts() -> StagingCounts | None:
    """The active transport's counts, or None when :func:`host_p2p` is not in effect."""
    return _ACTIVE[-1] if _ACTIVE else None


def _host_buffer(like: torch.Tensor) -> torch.Tensor:
    """An empty host tensor shaped like ``like``; pinned when ``like`` is on CUDA (a fast, synchronous copy)."""
    return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=like.is_cuda)


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of ``tensor``, complete when this returns (a blocking copy waits for the kernels producing it)."""
    host = _host_buffer(tensor)
    host.copy_(tensor.detach())
    return host


def _land(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy host buffers into their targets (receive buffers may be leaves that require grad)."""
    with torch.no_grad():
        for target, host in pairs:
            target.copy_(host)


class _StagedWork:
    """A gloo work object on host buffers, presented as the work on the caller's tensors.

    ``wait()`` and ``is_completed()`` keep torch's meaning: once either reports
    completion, received data is in the caller's tensors (copied in once).
    Anything else is the underlying work's.
    """

    def __init__(self, inner: Any, landing: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
                 keep: torch.Tensor | None = None) -> None:
        self._inner = inner
        self._landing = list(landing)  # (caller's tensor, host buffer) to copy on completion
        self._keep = keep  # a send's host copy: alive until the work is dropped
        self._done = False  # seen complete: later waits return at once (a gloo recv waited twice can hang)

    def _landed(self) -> None:
        self._done = True
        if self._landing:
            pairs, self._landing = self._landing, []
            _land(pairs)

    def wait(self, timeout: datetime.timedelta | None = None) -> Any:
        if self._done:
            return True
        ok = self._inner.wait() if timeout is None else self._inner.wait(timeout)
        if ok is not False:
            self._landed()
        return ok

    def is_completed(self) -> bool:
        if self._done:
            return True
        done = bool(self._inner.is_completed())
        if done:
            self._landed()
        return done

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _Transport:
    """The staged replacements, bound to the real functions they wrap and to one set of counts."""

    def __init__(self, real: dict[str, Any], counts: StagingCounts) -> None:
        self.real = real
        self.counts = counts

    # -- point to point
    def isend(self, tensor: torch.Tensor, dst: int | None = None, *args: Any, **kwargs: Any) -> _StagedWork:
        host = _to_host(tensor)
        self.counts.sends += 1
        self.counts.bytes_staged += host.nbytes
        return _StagedWork(self.real["isend"](host, dst, *args, **kwargs), keep=host)

    def irecv(self, tensor: torch.Tensor, src: int | None = None, *args: Any, **kwargs: Any) -> _StagedWork:
        host = _host_buffer(tensor)
        self.counts.recvs += 1
        self.counts.bytes_staged += host.nbytes
        return _StagedWork(self.real["irecv"](host, src, *args, **kwargs), landing=[(tensor, host)])

    def send(self, tensor: torch.Tensor, dst: int | None = None, *args: Any, **kwargs: Any) -> None:
        host = _to_host(tensor)
        self.counts.sends += 1
        self.counts.bytes_staged += host.nbytes
        self.real["send"](host, dst, *args, **kwargs)

    def recv(self, tensor: torch.Tensor, src: int | None = None, *args: Any, **kwargs: Any) -> int:
        host = _host_buffer(tensor)
        self.counts.recvs += 1
        self.counts.bytes_staged += host.nbytes
        sender = self.real["recv"](host, src, *args, **kwargs)
        _land([(tensor, host)])
        return sender

    def batch_isend_irecv(self, ops: Sequence[Any]) -> list[_StagedWork]:
        """Each op posted on its own: gloo does not coalesce, so this is what torch does for it too."""
        if not ops:
            raise ValueError("batch_isend_irecv: the list of P2POp is empty")
        works = []
        for op in ops:
            staged = self.isend if op.op in (self.isend, self.real["isend"]) else self.irecv
            works.append(staged(op.tensor, op.peer, group=op.group, tag=op.tag))
        return works

    # -- collectives (gloo has no CUDA all_gather; the others are staged alike, one code path)
    def _collective(self, call: Callable[..., Any], landing: list[tuple[torch.Tensor, torch.Tensor]],
                    async_op: bool) -> _StagedWork | None:
        self.counts.collectives += 1
        self.counts.bytes_staged += sum(host.nbytes for _, host in landing)
        work = call()
        if async_op:
            return _StagedWork(work, landing=landing)
        _land(landing)
        return None

    def all_reduce(self, tensor: torch.Tensor, *args: Any, async_op: bool = False, **kwargs: Any) -> Any:
        host = _to_host(tensor)
        return self._collective(lambda: self.real["all_reduce"](host, *args, async_op=async_op, **kwargs),
                                [(tensor, host)], async_op)

    def broadcast(self, tensor: torch.Tensor, *args: Any, async_op: bool = False, **kwargs: Any) -> Any:
        host = _to_host(tensor)
        return self._collective(lambda: self.real["broadcast"](host, *args, async_op=async_op, **kwargs),
                                [(tensor, host)], async_op)

    def all_gather(self, tensor_list: list[torch.Tensor], tensor: torch.Tensor, *args: Any,
                   async_op: bool = False, **kwargs: Any) -> Any:
        hosts = [_host_buffer(t) for t in tensor_list]
        mine = _to_host(tensor)
        return self._collective(lambda: self.real["all_gather"](hosts, mine, *args, async_op=async_op, **kwargs),
                                list(zip(tensor_list, hosts, strict=True)), async_op)

    def all_gather_into_tensor(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, *args: Any,
                               async_op: bool = False, **kwargs: Any) -> Any:
        host_out = _host_buffer(output_tensor)
        host_in = _to_host(input_tensor)
        return self._collective(
            lambda: self.real["all_gather_into_tensor"](host_out, host_in, *args, async_op=async_op, **kwargs),
            [(output_tensor, host_out)], async_op)

    def p2p_op_class(self) -> type:
        """``P2POp`` accepting the staged ``isend``/``irecv`` (torch checks ``op`` against its own two)."""
        real_class = self.real["P2POp"]
        unstaged = {self.isend: self.real["isend"], self.irecv: self.real["irecv"]}

        class StagedP2POp(real_class):  # type: ignore[misc, valid-type]
            def __new__(cls, op: Callable[..., Any], tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                return real_class.__new__(cls, unstaged.get(op, op), tensor, *args, **kwargs)

        StagedP2POp.__qualname__ = StagedP2POp.__name__ = "P2POp"
        return StagedP2POp


@contextlib.contextmanager
def host_p2p(enabled: bool = True) -> Iterator[StagingCounts | None]:
    """Stage every ``torch.distributed`` P2P transfer and collective through host memory for the block.

    ``enabled=False`` is a no-op yielding None (``--p2p-transport direct``).
    Yields the counts of what was staged. Restores ``torch.distributed`` on exit, also on error.
    """
    if not enabled:
        yield None
        return
    real = {name: getattr(dist, name) for name in _PATCHED}
    counts = StagingCounts()
    transport = _Transport(real, counts)
    staged = {name: getattr(transport, name) for name in _PATCHED if name != "P2POp"}
    staged["P2POp"] = transport.p2p_op_class()
    handle = ShimHandle()  # the CPU shims' patch record: restored last first, also on error
    _ACTIVE.append(counts)
    try:
        for name, value in staged.items():
            handle.record(dist, name)
            setattr(dist, name, value)
        yield counts
    finally:
        handle.uninstall()
        _ACTIVE.remove(counts)
