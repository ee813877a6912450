"""Run a ``torch.distributed`` collective and return only once the backend has let go of its tensors.

    collective(dist.all_reduce, x, op=dist.ReduceOp.SUM, group=group)   # as dist.all_reduce(x, ...)

Note [gloo drops a collective's tensors on its worker thread]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
ProcessGroupGloo runs a collective on one of its worker threads (``runLoop``), which marks the work
complete (``wait()`` returns) and only then, after some bookkeeping, drops its own reference to the
``Work`` and with it the tensors the work holds. Where the caller's handle is gone by then (a blocking
``dist.all_gather`` drops it on return), that thread destroys the ``Work``, and letting go of a tensor
that has a Python object takes the GIL (torch 2.13 decrefs the object when the tensor's C++ count falls
to one). Measured on 2 gloo ranks, 64 floats: the worker dropped an all-gather's tensors after the call
had returned in 106 of 400 calls (an all-reduce: 55 of 400).

Harmless while the interpreter runs, fatal at exit: once the interpreter is finalizing, a thread that
takes the GIL is made to exit (``pthread_exit``), the unwind crosses the work's ``noexcept`` destructor
and the process aborts, "terminate called without an active exception" (SIGABRT; the core's stack:
``runLoop -> ~AsyncAllgatherWork -> TensorImpl::decref_pyobject -> take_gil -> PyThread_exit_thread``,
the main thread in ``Py_FinalizeEx``), after the script printed correct results. The README recipe, whose
last collective is ``gather_sequence``'s all-gather, did so in 7 of 194 torchrun launches (2 ranks, 2 busy
loops on the 2 cores; 0 of 140 with this module). ``destroy_process_group`` does not prevent it: gloo's
threads stop only when the process group object dies, and the user's ``group`` still refers to it.

So every gloo collective of this package lends the backend aliases of its tensors (``detach()``: the
same storage under tensor objects only the backend holds), and returns once the backend has let go:
(1) every alias's Python object has died (a weakref callback, on whichever thread drops it; this thread
waits without the GIL, which the worker needs), then (2) the tensors' storages are referenced as before
the call (the alias and any view the backend made of it release their storage a moment after the
Python object goes, without the GIL). On return nothing of the caller's is left for gloo's thread to
release: no release can meet the interpreter's exit, and a buffer the caller drops is freed then and
there (``_release_now`` in ``collectives.py`` still frees temporaries before the caller's own reference
goes). Cost: one hand-over to gloo's thread where it had not let go yet (tens of microseconds).
Only CPU tensors on gloo groups: NCCL's works are retired by its watchdog thread, lazily, after the GPU.
"""

from __future__ import annotations

import sys
import threading
import time
import warnings
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist

# gloo lets go microseconds after wait() returns; the bound only keeps an unexpected holder from hanging a run
_RELEASE_TIMEOUT_S = 60.0
_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)  # strong references to a storage


class _Lent:
    """Aliases lent to a collective; ``wait`` returns once the backend has released all of them. Built from the
    call's arguments before any alias exists, so the storages' reference counts are as the caller left them."""

    def __init__(self, *objs: Any) -> None:
        self._lock = threading.Lock()
        self._alive = 0
        self._all_gone = threading.Event()
        self._refs: list[weakref.ref] = []  # to the aliases: a callback as each one's Python object dies
        self._storages: dict[int, Any] = {}  # the lent tensors' storages, by address: held until wait() returns
        for obj in objs:
            self._note(obj)
        self._before = {c: _storage_use_count(c) for c in self._storages}  # their reference counts now

    def _note(self, obj: Any) -> None:
        """Record the storage of ``obj`` (a tensor, or a list of them)."""
        if isinstance(obj, (list, tuple)):
            for t in obj:
                self._note(t)
        elif _lendable(obj) and obj.layout == torch.strided and _storage_use_count is not None:
            storage = obj.untyped_storage()
            self._storages.setdefault(storage._cdata, storage)

    def lend(self, obj: Any) -> Any:
        """``obj`` with every CPU tensor in it replaced by an alias of the same memory (``detach()``)."""
        if _lendable(obj):
            alias = obj.detach()
            with self._lock:
                self._alive += 1
            self._refs.append(weakref.ref(alias, self._gone))
            return alias
        if isinstance(obj, (list, tuple)) and any(_lendable(t) for t in obj):
            return type(obj)(self.lend(t) for t in obj)
        return obj

    def _gone(self, _ref: weakref.ref) -> None:  # on whichever thread drops the alias, holding the GIL
        with self._lock:
            self._alive -= 1
            if self._alive == 0:
                self._all_gone.set()

    @property
    def any(self) -> bool:
        return bool(self._refs)

    def wait(self) -> None:
        deadline = time.monotonic() + _RELEASE_TIMEOUT_S
        released = self._all_gone.wait(_RELEASE_TIMEOUT_S)
        while released and any(_storage_use_count(c) > n for c, n in self._before.items()):
            if time.monotonic() > deadline:
                released = False
            time.sleep(0)
        if not released:
            warnings.warn(f"the process group still holds tensors of a collective {_RELEASE_TIMEOUT_S:.0f}s after "
                          "it completed", RuntimeWarning, stacklevel=3)


def _lendable(obj: Any) -> bool:
    return isinstance(obj, torch.Tensor) and obj.device.type == "cpu"


def _is_gloo(group) -> bool:
    try:
        return "gloo" in str(dist.get_backend(group))
    except (RuntimeError, ValueError):  # not a process group this rank belongs to: the collective says so
        return False


def collective(fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)``, a blocking ``torch.distributed`` collective, returning once the backend has let
    go of every tensor it was given (Note [gloo drops a collective's tensors on its worker thread]). The group
    is ``kwargs["group"]`` (default: the world). Tensors and lists of tensors travel as aliases of the same
    memory: what the collective writes into them is the caller's."""
    if kwargs.get("async_op"):
        raise ValueError("collective() runs blocking collectives only")
    if sys.is_finalizing() or not _is_gloo(kwargs.get("group")):  # finalizing: gloo's threads cannot take the GIL
        return fn(*args, **kwargs)
    lent = _Lent(*args, *kwargs.values())
    args = tuple(lent.lend(a) for a in args)
    kwargs = {k: lent.lend(v) for k, v in kwargs.items()}
    if not lent.any:
        return fn(*args, **kwargs)
    result = fn(*args, **kwargs)  # an exception skips the wait: a failed work's tensors may be held anywhere
    del args, kwargs  # this frame's references to the aliases: what is left is the backend's
    lent.wait()
    return result
