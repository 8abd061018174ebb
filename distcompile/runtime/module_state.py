"""The state a module's forward changes, kept and put back: buffers, plain attributes, the
random number state (Note [First-step forward check] runs one forward three times).
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Iterator
from typing import TypeVar

import torch
from torch import nn

from .. import _torch_compat as compat
from .checkpoint import rng_state, set_rng_state
from .ops_seen import storage_key

__all__ = [
    "ModuleState",
    "fresh_inputs",
    "generator_states",
    "plain_state",
    "put_back",
    "put_plain_state_back",
    "set_generator_states",
]

T = TypeVar("T")

#: Values a snapshot of plain state takes as they are (they cannot change in place).
_ATOMS = (str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device)
#: Objects whose fields are not the model's to put back: torch's own, threads, loggers, files.
_FOREIGN = ("torch", "threading", "logging", "multiprocessing", "queue", "concurrent", "asyncio", "io")
_FUNCTIONS = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, functools.partial)
#: How deep a snapshot goes below a module's attribute (self.cfg["sched"]["n"]: two levels).
_DEPTH = 3


class ModuleState:
    """The module's buffers, Python attributes and the random number state, to put back.

    ``inputs``: the forward's arguments, whose generators get their states back too.

    Attributes are the public entries of each submodule's ``__dict__`` (a counter, a flag, a
    ``forward`` that a trainer patched in for one call: Lightning's forward redirection puts
    the original back when called), what lists, dicts, sets and plain objects among them
    hold put back in place (``plain_state``); a tensor
    among them (a count kept as a plain attribute, updated in place) is put back in place,
    and is a copy during ``copies()`` as buffers are; a ``torch.Generator`` among them gets
    its state back.

    Example:
        >>> m = nn.BatchNorm1d(2); m.seen = torch.zeros(()); state = ModuleState(m)
        >>> _ = m(torch.randn(4, 2)); m.seen += 4; state.restore()
        >>> int(m.num_batches_tracked), float(m.seen)
        (0, 0.0)
    """

    def __init__(self, module: nn.Module, inputs: object = ()) -> None:
        self.rng = rng_state()
        # Each module's buffer entries, by identity and value: a forward may resize a buffer
        # (an observer's empty min_val), assign a new one or register one (created lazily).
        self.buffers = [
            (
                m,
                {
                    n: (b, None if b is None else b.detach().clone())
                    for n, b in compat.module_dicts(m)[1].items()
                },
            )
            for m in module.modules()
        ]
        self.attrs = [(m, {k: v for k, v in vars(m).items() if k[:1] != "_"}) for m in module.modules()]
        values = [v for _, attrs in self.attrs for v in attrs.values()]
        self.plain = plain_state(values)
        self.generators = generator_states([*values, *compat.tree_leaves(inputs)])
        # Parameters: their data (aliases, no copy), put back where the forward replaced it
        # (``p.data = ...``); copies of those it writes in place come from ``OpsSeen.written``.
        self.params = [(p, p.data) for p in module.parameters()]
        self.written: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # Tensors among the attributes (not trainable ones): their values.
        self.tensors = [
            (m, k, v, v.detach().clone())
            for m, attrs in self.attrs
            for k, v in attrs.items()
            if isinstance(v, torch.Tensor) and not v.requires_grad
        ]

    def watched(self) -> dict[int, torch.Tensor]:
        """The parameters by storage address, for ``OpsSeen(watch=...)``, whose ``written``
        copies go to ``self.written``."""
        keys = [(storage_key(p), p) for p, _ in self.params if p.numel()]
        return {k: p for k, p in keys if k is not None}

    @contextlib.contextmanager
    def copies(self) -> Iterator[None]:
        """Inside, the module's buffers are copies (what a run writes to them, and what its
        autograd graph saves of them, stays there); after, the same objects as before."""
        for m, saved in self.buffers:
            entries = compat.module_dicts(m)[1]
            for name, (_, value) in saved.items():
                if value is not None:
                    entries[name] = value.clone()
        for m, k, _, value in self.tensors:  # put back as the objects they were by restore()
            vars(m)[k] = value.clone()
        try:
            yield
        finally:  # the buffers the module had; its attributes are the run's until restore()
            self._entries_back()

    def _entries_back(self) -> None:
        """Each module's buffer entries as they were: the same objects, none registered since."""
        for m, saved in self.buffers:
            entries = compat.module_dicts(m)[1]
            for name in [n for n in entries if n not in saved]:  # registered by the run
                compat.drop_buffer(m, name)
            for name, (b, _) in saved.items():
                entries[name] = b  # the object it was, if the run assigned another

    def restore(self) -> None:
        self._entries_back()
        with torch.no_grad():
            for _, saved in self.buffers:
                for b, value in saved.values():
                    if b is not None:
                        put_back(b, value)
        for m, attrs in self.attrs:
            for k in [k for k in vars(m) if k[:1] != "_" and k not in attrs]:
                delattr(m, k)  # set by the run: not there before
            for k, v in attrs.items():
                setattr(m, k, v)
        put_plain_state_back(self.plain)
        with torch.no_grad():
            for _, _, t, value in self.tensors:
                put_back(t, value)
            for p, data in self.params:
                if p.data_ptr() != data.data_ptr():
                    p.data = data
            for p, value in self.written.values():
                put_back(p, value)
        set_generator_states(self.generators)
        set_rng_state(self.rng)


def plain_state(values: list) -> list[tuple[object, object]]:
    """What ``values`` hold, in place, for ``put_plain_state_back``: the entries of each list,
    dict and set among them and the fields of each plain Python object (a counter kept in a
    ``self.meter`` object or a ``self.cfg["sched"]`` dict and stepped in forward), down to
    ``_DEPTH`` levels; tensors, modules, generators and objects of torch, threads or loggers
    are left out, as is anything that cannot be read.

    Example:
        >>> cfg = {"sched": {"n": 0}}; saved = plain_state([cfg]); cfg["sched"]["n"] += 1
        >>> put_plain_state_back(saved); cfg
        {'sched': {'n': 0}}
    """
    out: list[tuple[object, object]] = []
    seen: set[int] = set()
    level = list(values)
    for _ in range(_DEPTH + 1):
        below = []
        for v in level:
            if isinstance(v, _ATOMS) or id(v) in seen or _foreign(v):
                continue
            seen.add(id(v))
            try:
                held = _held(v)
            except Exception:  # noqa: BLE001 - an object that cannot be read is left as it is
                continue
            if held is not None:
                out.append((v, held))
                below.extend(held.values() if isinstance(held, dict) else held)
        level = below
    return out


def _foreign(v: object) -> bool:
    if isinstance(v, (torch.Tensor, nn.Module, torch.Generator, type, _FUNCTIONS)):
        return True
    return type(v).__module__.split(".")[0] in _FOREIGN


def _held(v: object) -> dict | list | set | None:
    if isinstance(v, dict):
        return dict(v)
    if isinstance(v, list):
        return list(v)
    if isinstance(v, set):
        return set(v)
    return dict(vars(v)) if hasattr(v, "__dict__") else None


def put_plain_state_back(saved: list[tuple[object, object]]) -> None:
    """Each list, dict, set and object ``plain_state`` read holds what it held then (the same
    objects), where its entries changed."""
    for v, held in saved:
        try:
            if isinstance(v, list):
                if len(v) != len(held) or any(a is not b for a, b in zip(v, held)):
                    v[:] = held
                continue
            if isinstance(v, set):
                if v != held:
                    v.clear()
                    v.update(held)
                continue
            entries = v if isinstance(v, dict) else vars(v)
            if entries.keys() != held.keys() or any(entries[k] is not x for k, x in held.items()):
                entries.clear()
                entries.update(held)
        except Exception:  # noqa: BLE001 - one that refuses (a mapping that forbids update) stays
            continue


def generator_states(values: list) -> list[tuple[torch.Generator, torch.Tensor]]:
    """The ``torch.Generator`` objects among ``values`` (what the modules keep as attributes:
    noise a module draws from its own; a forward's arguments: diffusers' ``AutoencoderKL``
    samples from a ``generator=`` it is given), with their states, for ``set_generator_states``.

    Example:
        >>> gen = torch.Generator().manual_seed(0); states = generator_states([gen, 3])
        >>> a = torch.rand(1, generator=gen); set_generator_states(states)
        >>> bool(torch.equal(a, torch.rand(1, generator=gen)))
        True
    """
    found = {id(g): g for g in values if isinstance(g, torch.Generator)}
    return [(g, g.get_state()) for g in found.values()]


def set_generator_states(states: list[tuple[torch.Generator, torch.Tensor]]) -> None:
    """Put back what ``generator_states`` read."""
    for g, state in states:
        g.set_state(state)


def put_back(b: torch.Tensor, value: torch.Tensor) -> None:
    """``b``'s values (and size) as ``value``'s, in place where it can be.

    Example:
        >>> b = torch.zeros(0); put_back(b, torch.ones(2)); b.tolist()
        [1.0, 1.0]
    """
    if b.shape == value.shape and b.dtype == value.dtype:
        b.copy_(value)
        return
    try:
        b.resize_(value.shape).copy_(value)  # resized by the run (resize_ keeps the object)
    except RuntimeError:  # a tensor that cannot be resized in place: take the saved one's data
        b.data = value.clone()


def fresh_inputs(inputs: T) -> T:
    """``inputs`` (a forward's args and kwargs) with each tensor a copy of its own, for a run
    that must leave the caller's tensors alone: a forward may update its input in place
    (``x.div_(255)``), legally, once. Same values, strides, ``requires_grad`` and Python
    attributes (``mark_dynamic``'s), outside any autograd graph; one copy per tensor object;
    a tensor whose strides a copy cannot have (an expanded one, which no forward can update
    in place) is passed as it is.

    Example:
        >>> x = torch.ones(2); (a, b), k = fresh_inputs(((x, x), {"y": 3}))
        >>> a is b, a is x, k
        (True, False, {'y': 3})
    """
    copies: dict[int, torch.Tensor] = {}

    def fresh(t: torch.Tensor) -> torch.Tensor:
        c = copies.get(id(t))
        if c is None:
            c = t.detach().clone()
            if c.stride() != t.stride():
                c = t
            else:
                c.requires_grad_(t.requires_grad)
                vars(c).update(vars(t))  # its Python attributes: torch._dynamo.mark_dynamic's marks
            copies[id(t)] = c
        return c

    return compat.tree_map_only(torch.Tensor, fresh, inputs)
