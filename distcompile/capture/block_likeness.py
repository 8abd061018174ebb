"""Whether two module instances would trace the same graph (Note [Regions only for blocks alike]).

Note [Regions only for blocks alike]
------------------------------------
Background: a nested compile region lets TorchDynamo trace a block once and stamp out
that trace for later calls; whether a later call may reuse it is decided from the guards
of the first trace, re-aimed at the later block (torch/_dynamo/variables/invoke_subgraph.py,
Note [invoke_subgraph subgraph reuse]). Those guards are not always enough. Minimal form
(torch 2.13 and 2.14, plain ``torch.compile`` too once the blocks are marked): two blocks of
one class ``x + self.act(self.lin(x))``, the first holding ``nn.Identity`` and the second
``nn.ReLU``, fed by a layer before them; the second block reused the first's trace, and its
ReLU was never applied (``tests/capture/test_regions.py``). timm's ViT with a linear
drop-path schedule is the same case in the wild: block 0 holds ``nn.Identity`` where the
later blocks hold ``DropPath``, and every block trained without drop path, silently.

Algorithm: before marking blocks as regions, distcompile computes for each block a
*likeness key*, and only blocks with equal keys share a region; a block alone in its key
is traced on its own. The key covers everything in the block's own module tree that can
change what its ``forward`` traces:

- each submodule's path in the block and its class;
- each parameter's and buffer's name, class, shape, dtype, device and ``requires_grad``
  (their values are graph inputs: they may differ);
- every other attribute in each submodule's ``__dict__``: numbers, strings, booleans and
  ``None`` by their type only, containers by their shape and their items' kinds, and
  functions, classes and other objects by identity (two blocks that share one config
  object agree; a copy of it in each block makes them differ, which costs speed, never
  correctness); methods by function and owner (a submodule owner by its path in the
  block);
- the forward, pre-forward and backward hooks on each submodule, by identity.

Why numbers and flags by type only: TorchDynamo guards every such value its first trace
read (a drop rate, a scale, a flag, ``training``), and the re-aimed guards reject a block
whose values differ: checked for dropout rates, a LeakyReLU slope, a scale, a flag that
picks a branch, ``training`` on either block, each in both orders. Comparing the values
too would split the layers of every Hugging Face model (each holds its own
``layer_idx``) and lose the regions there. What the guards miss is a submodule the first
trace read nothing from (``nn.Identity``): its class is guarded by nothing, so classes,
parameters, buffers and hooks are ours to compare.

Each group of one class gets a marked subclass of its own. TorchDynamo keys its reuse
cache on the function's code, which the groups share, but it guards the block's own class,
so one group never reuses another's trace (checked: Identity and Scale blocks interleaved,
``tests/capture/test_regions.py``).

What the key does not cover: state outside the block (globals, the caller's arguments:
TorchDynamo checks arguments itself), and attributes set by ``forward`` during tracing.
The first-step check (Note [First-step forward check]) compares the compiled forward with
eager's as a second line of defence.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
from collections.abc import Hashable

import torch
from torch import nn

__all__ = ["describe_difference", "likeness_key"]

#: ``nn.Module.__dict__`` entries that are compared apart (parameters, buffers, submodules,
#: hooks) or cannot change what forward traces (state_dict plumbing).
_APART = frozenset(
    {
        "_parameters",
        "_buffers",
        "_modules",
        "_non_persistent_buffers_set",
        "_state_dict_hooks",
        "_state_dict_pre_hooks",
        "_load_state_dict_pre_hooks",
        "_load_state_dict_post_hooks",
    }
)
_HOOKS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)
_MAX_DEPTH = 6


def _value(v: object, paths: dict[int, str], depth: int = 0) -> Hashable:
    """A hashable stand-in for ``v`` that is equal for values that trace alike."""
    if depth > _MAX_DEPTH:
        return ("id", id(v))
    if v is None or isinstance(v, (bool, int, float, complex, str, bytes)):
        return type(v).__name__  # the value: TorchDynamo guards it where the trace reads it
    if isinstance(v, (torch.dtype, torch.device, enum.Enum)):
        return (type(v).__name__, str(v))
    if isinstance(v, (tuple, list)):
        return (type(v).__name__, tuple(_value(x, paths, depth + 1) for x in v))
    if isinstance(v, dict):
        return (
            "dict",
            tuple((_value(k, paths, depth + 1), _value(x, paths, depth + 1)) for k, x in v.items()),
        )
    if isinstance(v, (set, frozenset)):
        return (type(v).__name__, tuple(sorted(repr(_value(x, paths, depth + 1)) for x in v)))
    if isinstance(v, nn.Module) and id(v) in paths:
        return ("submodule", paths[id(v)])  # the block's own (an alias): by its path in the block
    if isinstance(v, types.MethodType):
        owner = v.__self__
        return ("method", id(v.__func__), paths.get(id(owner), id(owner)))
    if isinstance(v, functools.partial):
        return (
            "partial",
            _value(v.func, paths, depth + 1),
            _value(v.args, paths, depth + 1),
            _value(v.keywords, paths, depth + 1),
        )
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        fields = tuple(
            (f.name, _value(getattr(v, f.name, None), paths, depth + 1)) for f in dataclasses.fields(v)
        )
        return ("dataclass", id(type(v)), fields)
    return ("id", id(v))  # tensors, functions, classes, other objects: the very same object


def _tensor_meta(t: torch.Tensor | None) -> Hashable:
    if t is None:
        return None
    return (type(t).__name__, tuple(t.shape), t.dtype, str(t.device), t.requires_grad)


def likeness_key(block: nn.Module) -> tuple:
    """What must be equal for two instances to trace the same graph (Note [Regions only for blocks alike]).

    A tuple of ``(submodule path, what, value)`` entries, in ``named_modules`` order.

    Example:
        >>> a = nn.Sequential(nn.Linear(2, 2), nn.Identity())
        >>> b = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        >>> likeness_key(a) == likeness_key(nn.Sequential(nn.Linear(2, 2), nn.Identity())), likeness_key(a) == likeness_key(b)
        (True, False)
    """
    modules = list(block.named_modules(remove_duplicate=False))
    paths = {id(m): path for path, m in reversed(modules)}  # an alias gets its first path
    entries: list[tuple] = []
    for path, m in modules:
        entries.append((path, "class", id(type(m)), type(m).__qualname__))
        state = vars(m)
        for name, p in state.get("_parameters", {}).items():
            entries.append((path, f"parameter {name}", _tensor_meta(p)))
        for name, b in state.get("_buffers", {}).items():
            entries.append((path, f"buffer {name}", _tensor_meta(b)))
        for name in _HOOKS:
            hooks = state.get(name)
            if hooks:
                entries.append((path, name.lstrip("_"), _value(list(hooks.values()), paths)))
        for name, v in state.items():
            if name not in _APART and name not in _HOOKS:
                entries.append((path, f"attribute {name}", _value(v, paths)))
    return tuple(entries)


def describe_difference(a: tuple, b: tuple, *, a_name: str, b_name: str) -> str:
    """The first entry where two likeness keys differ, for the compile log.

    Example:
        >>> a = likeness_key(nn.Sequential(nn.Linear(2, 2), nn.Identity()))
        >>> b = likeness_key(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
        >>> describe_difference(a, b, a_name="blocks.0", b_name="blocks.1")
        'blocks.0.1 is Identity where blocks.1.1 is ReLU'
    """
    da, db = {x[:2]: x for x in a}, {y[:2]: y for y in b}
    for k in dict.fromkeys([*da, *db]):
        x, y = da.get(k), db.get(k)
        if x == y:
            continue
        if x is None or y is None:
            has, lacks = (b_name, a_name) if x is None else (a_name, b_name)
            return f"{_at(has, k[0])} has {k[1]} where {_at(lacks, k[0])} has none"
        if k[1] == "class":
            return f"{_at(a_name, k[0])} is {x[3]} where {_at(b_name, k[0])} is {y[3]}"
        return f"{k[1]} of {_at(a_name, k[0])} differs from {_at(b_name, k[0])}'s"
    return f"{a_name} and {b_name} are alike"


def _at(block: str, path: str) -> str:
    return f"{block}.{path}" if path else block
