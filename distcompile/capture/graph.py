"""Read a TorchDynamo graph into the planner's terms.

TorchDynamo hands the backend an FX graph whose trainable parameters arrive either as
placeholders (the default since ``inline_inbuilt_nn_modules``) whose example input is
the real ``nn.Parameter``, as ``get_attr`` nodes, or inside ``call_module`` nodes. Both are mapped back to the
parameter's qualified name in the wrapped module, so names match on every rank.
"""

from __future__ import annotations

import re
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from ..errors import UnsupportedModelError
from ..planning.plan import NodeInfo
from .blocks import find_blocks

__all__ = [
    "CapturedGraph",
    "read_graph",
    "own_forward_code",
    "structure",
    "lookup_indices",
    "refuse_untracked",
]


@dataclass(frozen=True, slots=True)
class CapturedGraph:
    """A forward graph reduced to what planning needs.

    Attributes:
        body: The partitionable nodes (not placeholders, ``get_attr`` or output), in order.
        nodes: One :class:`NodeInfo` per body node.
        params: Trainable parameter name -> parameter, for the parameters the graph receives.
        blocks: Groups of repeated blocks as body index ranges (``capture.blocks``).
        sealed: ``(first, last)`` body index ranges no cut may split: a size known only from
            the data (``nonzero``, a boolean mask) made at ``first`` and still read at ``last``.
    """

    body: tuple[fx.Node, ...]
    nodes: tuple[NodeInfo, ...]
    params: Mapping[str, torch.nn.Parameter]
    blocks: tuple[tuple[tuple[int, int], ...], ...] = ()
    sealed: tuple[tuple[int, int], ...] = ()


def _get_attr(gm: fx.GraphModule, qualname: str) -> object:
    obj: object = gm
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def read_graph(
    gm: fx.GraphModule,
    example_inputs: Sequence[object],
    names_by_id: Mapping[int, str],
) -> CapturedGraph:
    """Map ``gm``'s parameter inputs to names and list each node's parameter reads.

    Args:
        gm: The graph TorchDynamo passed to the backend.
        example_inputs: The backend's example inputs, one per placeholder.
        names_by_id: ``id(param) -> qualified name`` for the wrapped module's trainable
            parameters.

    Example:
        >>> lin = torch.nn.Linear(2, 2)
        >>> gm = fx.symbolic_trace(lin)
        >>> cg = read_graph(gm, [torch.zeros(1, 2)], {id(p): n for n, p in lin.named_parameters()})
        >>> [n.params for n in cg.nodes]
        [('weight', 'bias')]
    """
    param_of: dict[fx.Node, str] = {}
    params: dict[str, torch.nn.Parameter] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, example_inputs):
        name = names_by_id.get(id(value))
        if name is not None and isinstance(value, torch.Tensor) and value.requires_grad:
            param_of[node] = name
            params[name] = value  # type: ignore[assignment]
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = _get_attr(gm, str(node.target))
            name = names_by_id.get(id(value))
            if name is not None and isinstance(value, torch.Tensor) and value.requires_grad:
                param_of[node] = name
                params[name] = value  # type: ignore[assignment]

    body = tuple(n for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output"))
    index = {n: i for i, n in enumerate(body)}
    nodes = []
    for node in body:
        reads: list[str] = []
        for arg in node.all_input_nodes:
            name = param_of.get(arg)
            if name is not None and name not in reads:
                reads.append(name)
        if node.op == "call_module":  # a submodule kept whole: it reads its own parameters
            for p in gm.get_submodule(str(node.target)).parameters():
                name = names_by_id.get(id(p))
                if name is not None and p.requires_grad and name not in reads:
                    reads.append(name)
                    params[name] = p
        last_user = max(
            (len(body) if u.op == "output" else index.get(u, -1) for u in node.users),
            default=-1,
        )
        nodes.append(NodeInfo(node.name, tuple(reads), last_user, _lookups(node, param_of)))
    return CapturedGraph(
        body=body, nodes=tuple(nodes), params=params, blocks=find_blocks(body), sealed=_sealed(body)
    )


def _untracked(
    gm: fx.GraphModule, example_inputs: Sequence[object], known: set[int] | frozenset[int]
) -> list[torch.nn.Parameter]:
    """The trainable ``nn.Parameter``s ``gm`` receives or reads whose ``id`` is not in ``known``.

    Example:
        >>> lin = torch.nn.Linear(2, 2)
        >>> gm = fx.symbolic_trace(lin)
        >>> [tuple(p.shape) for p in _untracked(gm, [torch.zeros(1, 2)], {id(lin.bias)})]
        [(2, 2)]
    """
    values = list(example_inputs)[: sum(1 for n in gm.graph.nodes if n.op == "placeholder")]
    values += [_get_attr(gm, str(n.target)) for n in gm.graph.nodes if n.op == "get_attr"]
    values += [
        p
        for n in gm.graph.nodes
        if n.op == "call_module"
        for p in gm.get_submodule(str(n.target)).parameters()
    ]
    found: dict[int, torch.nn.Parameter] = {}
    for v in values:
        if isinstance(v, torch.nn.Parameter) and v.requires_grad and id(v) not in known:
            found.setdefault(id(v), v)
    return list(found.values())


def refuse_untracked(
    gm: fx.GraphModule, example_inputs: Sequence[object], known: set[int], *, rank: int, graph_id: int
) -> None:
    """Raise if ``gm`` reads a trainable parameter not in ``known`` (the reducer's, and those DDP
    ignores): its gradient would never be averaged (Note [Parameters that change after wrap]).

    Example:
        >>> lin = torch.nn.Linear(2, 2)
        >>> refuse_untracked(fx.symbolic_trace(lin), [torch.zeros(1, 2)], {id(p) for p in lin.parameters()},
        ...                  rank=0, graph_id=0)
    """
    found = _untracked(gm, example_inputs, known)
    if found:
        shapes = ", ".join(f"{tuple(p.shape)} {p.dtype}" for p in found[:4])
        raise UnsupportedModelError(
            f"rank {rank}: graph {graph_id} reads {len(found)} trainable parameter(s) ({shapes}) that the "
            "wrapped model did not hold when distcompile last took its parameters, so their gradients "
            "would never be averaged across ranks. A parameter the model registers (a new module "
            "assigned, unfreezing, load_state_dict(assign=True)) is taken at the next training forward; "
            "a parameter from outside the model (another module's, passed in or read from a closure) is "
            "not: register it in the wrapped model, or detach it / set requires_grad=False if it is not "
            "meant to train here."
        )


def _unbacked(value: object) -> set:
    try:
        return set(free_unbacked_symbols(value))
    except Exception:  # noqa: BLE001 - a value the helper does not know: no sizes of its own
        return set()


def _sealed(body: Sequence[fx.Node]) -> tuple[tuple[int, int], ...]:
    """Spans of ``body`` from the node that makes a data-dependent size (an unbacked symbol,
    as ``nonzero`` or a boolean-mask index does) to the last node that reads a value of that
    size. Inductor compiles a piece only if every such size it makes leaves it as the size of
    an output, so a cut inside such a span fails (``PendingUnbackedSymbolNotFound``)."""
    index = {n: i for i, n in enumerate(body)}
    first: dict[object, int] = {}
    last: dict[object, int] = {}
    for i, node in enumerate(body):
        for sym in _unbacked(node.meta.get("example_value")):
            first.setdefault(sym, i)
            last[sym] = i
        for arg in node.all_input_nodes:
            if arg in index:
                for sym in _unbacked(arg.meta.get("example_value")):
                    last[sym] = max(last.get(sym, i), i)
        for user in node.users:
            if user.op == "output":
                for sym in _unbacked(node.meta.get("example_value")):
                    last[sym] = len(body)
    return tuple(sorted((first[s], last[s]) for s in first if last[s] > first[s]))


#: Embedding lookups as TorchDynamo records them, and where each takes its table.
_LOOKUPS = {
    torch.nn.functional.embedding: lambda n: n.kwargs.get("weight", n.args[1] if len(n.args) > 1 else None),
    torch.embedding: lambda n: n.args[0] if n.args else n.kwargs.get("weight"),
    torch.ops.aten.embedding.default: lambda n: n.args[0] if n.args else n.kwargs.get("weight"),
}


def _lookups(node: fx.Node, param_of: dict[fx.Node, str]) -> tuple[str, ...]:
    """The parameter read as the table of an embedding lookup at ``node`` (dense gradient only)."""
    table = _LOOKUPS.get(node.target) if node.op == "call_function" else None  # type: ignore[arg-type]
    if table is None or node.kwargs.get("sparse") or (len(node.args) > 6 and node.args[6]):
        return ()
    name = param_of.get(table(node))  # type: ignore[arg-type]
    return (name,) if name is not None else ()


def lookup_indices(captured: CapturedGraph) -> dict[str, int]:
    """Table name -> how many indices the graph looks up in it per call (from the traced
    example values; tables whose index shape is not known are left out).

    Example:
        >>> emb = torch.nn.Embedding(10, 4)
        >>> gm = fx.symbolic_trace(emb)
        >>> cg = read_graph(gm, [torch.zeros(2, 3, dtype=torch.long)], {id(emb.weight): "weight"})
        >>> lookup_indices(cg)  # symbolic_trace records no example values
        {}
    """
    found: dict[str, int] = {}
    for fx_node, info in zip(captured.body, captured.nodes):
        if not info.lookups:
            continue
        table = _LOOKUPS[fx_node.target](fx_node)  # type: ignore[index]
        indices = [a for a in fx_node.all_input_nodes if a is not table]
        value = indices[0].meta.get("example_value") if indices else None
        if not isinstance(value, torch.Tensor):
            continue
        count = value.numel()
        if not isinstance(count, int):  # a symbolic size: unknown (int() would specialize it)
            continue
        found[info.lookups[0]] = found.get(info.lookups[0], 0) + count
    return found


def _module_path(source: str) -> str:
    """TorchDynamo's source of a module (``L['self'].layers[0].attn``) as its path (``layers.0.attn``)."""
    path = re.sub(r"^L\['self'\]\.?", "", source)
    path = re.sub(r"^L\['([^']+)'\]", r"\1", path)
    path = re.sub(r"\['([^']+)'\]", r".\1", path)
    return re.sub(r"\[(\d+)\]", r".\1", path)


def _where(node: fx.Node) -> str:
    """``module.path (file:line)`` of the user code that made ``node``."""
    stack = node.meta.get("nn_module_stack") or {}
    path = _module_path(str(next(reversed(stack.values()))[0])) if stack else ""
    trace = [line.strip() for line in (node.meta.get("stack_trace") or "").splitlines() if line.strip()]
    files = [line for line in trace if line.startswith("File ")]
    loc = (
        files[-1].split(", in ")[0].removeprefix("File ").replace('"', "").replace(", line ", ":")
        if files
        else ""
    )
    return " ".join(part for part in (path, f"({loc})" if loc else "") if part)


def _target(node: fx.Node) -> str:
    target = node.target
    return target if isinstance(target, str) else getattr(target, "__name__", type(target).__name__)


def structure(captured: CapturedGraph) -> list[str]:
    """What ranks must agree on in a graph, one line per node: the operation, the parameters it
    reads, and where in the user's code it comes from; no sizes (they may differ by data).

    Example:
        >>> lin = torch.nn.Linear(2, 2)
        >>> cg = read_graph(fx.symbolic_trace(lin), [torch.zeros(1, 2)], {id(p): n for n, p in lin.named_parameters()})
        >>> structure(cg)
        ['call_function linear reads weight, bias']
    """
    lines = []
    for node, info in zip(captured.body, captured.nodes):
        line = f"{node.op} {_target(node)}" + (f" reads {', '.join(info.params)}" if info.params else "")
        where = _where(node)
        lines.append(f"{line} | {where}" if where else line)
    return lines


def own_forward_code(module: torch.nn.Module, tag: str) -> torch.nn.Module:
    """Give ``module`` a private copy of its class's ``forward`` code object; return it.

    TorchDynamo caches compiled code per code object. Several models of one class that are
    compiled with different backends (benchmark variants, ``explain``'s throw-away capture)
    would otherwise share one cache: every call evaluates every model's guards, and
    clearing one model's entries clears the others'. The module's class becomes a
    subclass whose ``forward`` runs the same code under a new code object.

    Example:
        >>> lin = own_forward_code(torch.nn.Linear(2, 2), "x")
        >>> code = type(lin).forward.__code__
        >>> code == torch.nn.Linear.forward.__code__, code.co_name
        (False, 'forward')
    """
    cls = type(module)
    fwd = cls.forward
    if not isinstance(fwd, types.FunctionType):
        return module
    # A distinct, unequal code object that keeps its name (graph breaks and tracebacks say
    # "in forward", the user's method): the tag goes in as an extra, unused constant.
    code = fwd.__code__.replace(co_consts=(*fwd.__code__.co_consts, f"distcompile:{tag}"))
    copy = types.FunctionType(code, fwd.__globals__, code.co_name, fwd.__defaults__, fwd.__closure__)
    copy.__kwdefaults__ = fwd.__kwdefaults__
    module.__class__ = type(cls.__name__, (cls,), {"forward": copy, "__module__": cls.__module__})
    return module
