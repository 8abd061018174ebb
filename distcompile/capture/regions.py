"""Note [Nested compile regions]: repeated blocks traced once, inlined back for planning.

TorchDynamo traces a model's code once per call: a 32-layer transformer costs 32 traces
of its block (about 0.04 s each on the benchmark GPT). ``torch.compiler.nested_compile_region``
lets it trace a function once and reuse that trace for later calls whose inputs and
guards match (``invoke_subgraph`` nodes that share one body graph). :func:`mark_repeated_blocks`
marks the blocks of a container (``nn.ModuleList`` / ``nn.Sequential`` children of one
class with submodules of their own) that way before capture, and :func:`inline_regions`
puts each call's copy of the body back into the captured graph, so that planning,
splitting and compiling see the same graph as without regions (each copied node
keeps its module path, rewritten to the block it belongs to).

What TorchDynamo cannot trace as a region (a graph break inside a block, dynamic shapes
on some models) raises instead of falling back; the caller then unmarks the blocks and
captures again (``runtime.module``), at the first call or at a recompile; ``regions=False``
does without them. Measured on the benchmark GPT at 32 layers (torch 2.13, one process):
TorchDynamo's trace took 1.26 s, 0.48 s with regions, and the inlined graph had the same
operations and module paths as the graph traced without.

Note [Regions under checkpoint]
-------------------------------
Hugging Face's ``gradient_checkpointing_enable()`` checkpoints each block from outside
(``checkpoint(block.__call__, x)``), so TorchDynamo puts each block's region call inside a
``tag_activation_checkpoint`` body, all calling one shared region graph. Left there, it
reached AOTAutograd, and torch 2.13 got it wrong under two backends. With Inductor, the
backward recomputes the block by calling the region's compiled forward, whose outputs
saved for backward include views of the block's weights (a transposed ``Linear``
weight); the enclosing backward graph treats that call's outputs as buffers of its own
and reused one, the transposed weight of block 0, for a gradient of the same shape
computed later (an input layer's or position embedding's). Block 0's weights were
overwritten during ``backward()``: step 0's gradients were right, training was wrong from
step 1 (BERT: LayerNorm weights near 0.01), and since each rank's corruption came from its
own gradients, the ranks parted. With ``backend="eager"`` the region's autograd function
asserted "fake_mode should be enabled for HOPs" in backward. (Related upstream fix of
another region aliasing bug in Inductor: pytorch#193960.) So every region call is
inlined, in the bodies of other higher-order ops too, and a call that is still left raises
:class:`RegionNotInlined`, which captures the model again without regions: no region
ever reaches AOTAutograd. Reproduced in small by ``tests.models.CheckpointAround``.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable

import torch
from torch import fx, nn

from .block_likeness import describe_difference, likeness_key

__all__ = [
    "RegionNotInlined",
    "has_repeated_blocks",
    "inline_regions",
    "mark_repeated_blocks",
    "region_failure_reason",
]


log = logging.getLogger(__name__)


class RegionNotInlined(RuntimeError):
    """A region call that cannot be copied back: its outputs read whole, or an input of
    another kind than its body was traced with."""


def _candidates(module: nn.Module) -> list[list[nn.Module]]:
    """Children of one class with submodules of their own, per container, in order."""
    groups: list[list[nn.Module]] = []
    for container in module.modules():
        if type(container) not in (nn.ModuleList, nn.Sequential):
            continue
        by_class: dict[type, list[nn.Module]] = {}
        for child in container.children():
            cls = type(child)
            own = not cls.__module__.startswith("torch.") and "forward" in vars(cls)
            own = own and "_distcompile_region" not in vars(cls)  # marked already (another wrap)
            if own and any(True for _ in child.children()):
                by_class.setdefault(cls, []).append(child)
        groups.extend(g for g in by_class.values() if len(g) > 1)
    return groups


def _alike(blocks: list[nn.Module], names: dict[int, str]) -> tuple[list[list[nn.Module]], str]:
    """``blocks`` (one class) split by likeness key (Note [Regions only for blocks alike]):
    the groups of two or more, and a line on the blocks left out ("" when none is)."""
    keys = [likeness_key(b) for b in blocks]
    by_key: dict[tuple, list[int]] = {}
    for i, k in enumerate(keys):
        by_key.setdefault(k, []).append(i)
    groups = [[blocks[i] for i in idx] for idx in by_key.values() if len(idx) > 1]
    alone = [idx[0] for idx in by_key.values() if len(idx) == 1]
    if len(by_key) == 1:
        return groups, ""
    # Name one difference: the first block that does not look like the first block.
    other = next(i for i, k in enumerate(keys) if k != keys[0])
    why = describe_difference(
        keys[0], keys[other], a_name=names[id(blocks[0])], b_name=names[id(blocks[other])]
    )
    shared = sum(len(g) for g in groups)
    line = (
        f"{len(blocks)} {type(blocks[0]).__name__} blocks are not all alike ({why}): "
        f"{shared} traced as {len(groups)} region(s), {len(alone)} on their own"
    )
    return groups, line


def _repeated_blocks(module: nn.Module) -> tuple[list[list[nn.Module]], list[str]]:
    """The groups of blocks that may share a region, and a line per class split by likeness."""
    names = {id(m): n for n, m in module.named_modules(remove_duplicate=False)}
    groups: list[list[nn.Module]] = []
    lines: list[str] = []
    for blocks in _candidates(module):
        alike, line = _alike(blocks, names)
        groups.extend(alike)
        if line:
            lines.append(line)
    return groups, lines


def has_repeated_blocks(module: nn.Module) -> bool:
    """Whether ``mark_repeated_blocks`` would mark anything in ``module`` (``regions`` matters).

    Example:
        >>> has_repeated_blocks(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
        False
    """
    return bool(_candidates(module))


def _as(cls: type) -> Callable:
    """A ``__reduce_ex__`` that pickles and copies a marked block as its own class (unmarked)."""

    def reduce(self: object, protocol: int) -> tuple:
        return (_rebuild, (cls, self.__getstate__()))

    return reduce


def _rebuild(cls: type, state: dict) -> object:
    obj = cls.__new__(cls)
    obj.__setstate__(state)
    return obj


def mark_repeated_blocks(module: nn.Module) -> Callable[[], None] | None:
    """Mark ``module``'s repeated blocks as nested compile regions; return what unmarks them.

    Blocks share a region only when they are alike (Note [Regions only for blocks alike]);
    each group gets its own subclass of their class whose ``forward`` is the region (one
    function for the group, so that TorchDynamo reuses its trace; TorchDynamo guards the
    block's class, so no other group reuses it). Blocks of a class that are not all alike
    are named in one log line. None when there is nothing to mark or the torch release has
    no regions.

    Example:
        >>> mark_repeated_blocks(nn.Linear(2, 2)) is None
        True
    """
    region = getattr(torch.compiler, "nested_compile_region", None)
    if region is None:
        return None
    groups, lines = _repeated_blocks(module)
    for line in lines:
        log.info("regions: %s", line)
    if not groups:
        return None
    swapped: list[tuple[nn.Module, type]] = []
    for blocks in groups:
        cls = type(blocks[0])
        attrs = {"forward": region(cls.forward), "__module__": cls.__module__, "__reduce_ex__": _as(cls)}
        attrs["_distcompile_region"] = True
        marked = type(cls.__name__, (cls,), attrs)
        for block in blocks:
            swapped.append((block, cls))
            block.__class__ = marked

    def unmark() -> None:
        for block, cls in swapped:
            block.__class__ = cls

    names = {id(m): n for n, m in module.named_modules(remove_duplicate=False)}
    unmark.regions = "; ".join(  # type: ignore[attr-defined]  # for error messages
        f"{len(g)} {type(g[0]).__name__} blocks ({names[id(g[0])]} ... {names[id(g[-1])]})" for g in groups
    )
    return unmark


def region_failure_reason(exc: BaseException) -> str:
    """What TorchDynamo (or inlining) said about a region it could not trace, in one line.

    TorchDynamo's message opens with a preamble shared by every higher-order op; the graph
    break or error under it, and the first sentence of its explanation, say what happened.

    Example:
        >>> region_failure_reason(RuntimeError("Got graph break/error:\\n\\nAliasing\\n  Explanation: No alias. Found in x"))
        'Aliasing (No alias)'
    """
    text = str(exc)
    _, found, rest = text.partition("Got graph break/error:")
    lines = [line.strip() for line in (rest if found else text).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    why = next((line for line in lines[1:] if line.startswith("Explanation:")), "")
    why = why.removeprefix("Explanation:").strip().split(". ")[0].rstrip(".")
    out = f"{lines[0]} ({why})" if why else lines[0]
    return out if len(out) <= 240 else out[:237] + "..."


def _module_stack(node: fx.Node, call: fx.Node, first: fx.Node) -> dict:
    """``node``'s module stack as a copy for ``call``: the call's stack, then the body's
    entries under the block, moved from the first call's block path to this call's."""
    outer = dict(call.meta.get("nn_module_stack") or {})
    if not outer or not first.meta.get("nn_module_stack"):
        return outer
    here = next(reversed(outer.values()))[0]
    there = next(reversed(first.meta["nn_module_stack"].values()))[0]
    for key, (path, cls) in (node.meta.get("nn_module_stack") or {}).items():
        path = str(path)
        if path.startswith(there + "."):
            outer[f"{key}@{here}"] = (here + path[len(there) :], cls)
    return outer


def _same_kind(inner: fx.Node, outer: object) -> bool:
    """Whether a call passes what its body was traced with (a tensor for a tensor, ...).

    With dynamic shapes TorchDynamo (2.13) has passed a float constant to a body that takes a
    tensor and calls ``.item()`` on it; such a region is captured again without regions."""
    if not isinstance(outer, fx.Node):
        return False
    a, b = inner.meta.get("example_value"), outer.meta.get("example_value")
    return isinstance(a, torch.Tensor) == isinstance(b, torch.Tensor)


def _inline_call(
    gm: fx.GraphModule, call: fx.Node, first: fx.Node, firsts: dict[str, fx.Node], bodies: dict
) -> None:
    target = str(call.args[0].target)
    # TorchDynamo (2.13) keeps a region traced inside one checkpoint body as that body's
    # attribute, and a later checkpoint body that calls the same region names it without
    # holding it: the body is found among every graph module of the capture.
    body = getattr(gm, target, None) or bodies.get(target)
    if not isinstance(body, fx.GraphModule):
        raise RegionNotInlined(
            f"{call.name} calls a region body {target!r} that no graph of the capture holds"
        )
    _inline_here(body, firsts, bodies)  # regions inside the region
    graph = gm.graph
    env: dict[fx.Node, object] = {}
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    for inner, outer in zip(placeholders, call.args[2:]):
        if not _same_kind(inner, outer):
            raise RegionNotInlined(
                f"{call.name} passes {outer!r} where its body takes {inner.meta.get('example_value')!r}"
            )
        env[inner] = outer
    outputs: tuple = ()
    with graph.inserting_before(call):
        for node in body.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                outputs = tuple(fx.node.map_arg(node.args[0], lambda a: env[a]))
                break
            if node.op == "get_attr":  # a constant or a subgraph of the body: give it a home here
                name = f"_region_{call.name}_{node.target}"
                setattr(gm, name, getattr(body, str(node.target)))
                env[node] = graph.get_attr(name)
                continue
            new = graph.node_copy(node, lambda a: env[a])
            new.meta["nn_module_stack"] = _module_stack(node, call, first)
            env[node] = new
    for user in list(call.users):
        if user.op != "call_function" or user.target is not operator.getitem:
            raise RegionNotInlined(
                f"{user.format_node()} reads a nested compile region's outputs whole; "
                "wrap(..., regions=False) captures without regions"
            )
        user.replace_all_uses_with(outputs[user.args[1]])  # type: ignore[index]
        graph.erase_node(user)
    graph.erase_node(call)


def _region_calls(gm: fx.GraphModule) -> list[fx.Node]:
    invoke = getattr(torch.ops.higher_order, "invoke_subgraph", None)
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is invoke]


def inline_regions(gm: fx.GraphModule) -> fx.GraphModule:
    """Replace each ``invoke_subgraph`` call in ``gm`` by a copy of its body, in place; ``gm``.

    Calls inside the bodies of other higher-order ops (a checkpointed block) are inlined
    too, so that none reaches AOTAutograd (Note [Regions under checkpoint]); one left
    raises :class:`RegionNotInlined`, and the model is captured again without regions.

    Example:
        >>> inline_regions(fx.symbolic_trace(nn.Linear(2, 2))).graph.find_nodes(op="output")[0].op
        'output'
    """
    first: dict[str, fx.Node] = {}  # each region's first call, over all graphs in trace order
    graphs = [gm, *(m for m in gm.modules() if m is not gm and isinstance(m, fx.GraphModule))]
    bodies = {path.rpartition(".")[2]: m for path, m in gm.named_modules() if isinstance(m, fx.GraphModule)}
    try:
        for graph in graphs:
            _inline_here(graph, first, bodies)
    except RegionNotInlined:
        raise
    except Exception as exc:  # any other failure here: the model is captured again without regions
        raise RegionNotInlined(
            f"inlining the nested compile regions failed: {type(exc).__name__}: {exc}"
        ) from exc
    left = [n.name for m in gm.modules() if isinstance(m, fx.GraphModule) for n in _region_calls(m)]
    if left:
        raise RegionNotInlined(f"nested compile region calls left after inlining: {left[:3]}")
    return gm


def _inline_here(gm: fx.GraphModule, first: dict[str, fx.Node], bodies: dict) -> None:
    calls = _region_calls(gm)
    if not calls:
        return
    for call in calls:
        _inline_call(gm, call, first.setdefault(str(call.args[1]), call), first, bodies)
    for node in list(gm.graph.nodes):
        if node.op == "get_attr" and not node.users:
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.delete_all_unused_submodules()
    gm.recompile()
