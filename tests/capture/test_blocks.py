"""Finding repeated blocks in a TorchDynamo graph (one process, capture only)."""

from __future__ import annotations

import operator

import torch
from torch import nn

from distcompile.capture.graph import read_graph
from distcompile.models import GPT, GPTConfig
from tests.models import Repeats, mlp_seq


def _blocks(model: nn.Module, *inputs: torch.Tensor):
    names = {id(p): n for n, p in model.named_parameters()}
    seen = []

    def backend(gm, example_inputs):  # noqa: ANN001, ANN202 - a TorchDynamo backend
        seen.append(read_graph(gm, example_inputs, names))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend)(*inputs)
    (captured,) = seen
    return captured


def test_transformer_layers_are_one_group_cut_where_no_fusion_is_lost() -> None:
    # Note [Blocks cut where no fusion is lost]: each range starts at its layer's first linear,
    # so layer k's range is its work after ln_1, then layer k+1's ln_1; the last layer's tail
    # joins what follows it (ln_f, the head).
    captured = _blocks(
        GPT(GPTConfig(n_layer=5, n_embd=32, vocab_size=64, block_size=8)), torch.zeros(2, 8).long()
    )
    (group,) = captured.blocks
    assert len(group) == 4
    sizes = {stop - start for start, stop in group}
    assert len(sizes) == 1 and sizes.pop() > 10
    for (_, stop), (start, _) in zip(group, group[1:]):
        assert stop == start  # back to back, nothing between the layers
    for k, (start, stop) in enumerate(group):
        body = captured.body[start:stop]
        assert body[0].target is torch.nn.functional.linear, body[0]
        assert body[-1].target is torch.nn.functional.layer_norm, body[-1]
        owner = [str(list(n.meta["nn_module_stack"].values())[0][0]) for n in body]
        assert owner[-1] == f"L['self'].blocks.{k + 1}", owner
        assert set(owner[:-1]) == {f"L['self'].blocks.{k}"}, owner


def test_two_layers_are_not_rotated() -> None:
    # Rotated, two layers would leave one range: nothing to reuse. They stay the layers.
    captured = _blocks(
        GPT(GPTConfig(n_layer=2, n_embd=32, vocab_size=64, block_size=8)), torch.zeros(2, 8).long()
    )
    (group,) = captured.blocks
    assert len(group) == 2
    assert all(captured.body[start].target is torch.nn.functional.layer_norm for start, _ in group)


def test_blocks_not_back_to_back_are_not_rotated() -> None:
    # Something between the layers: the ranges stay the layers themselves.
    class Gapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(
                nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8), nn.GELU()) for _ in range(3)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x) * 0.5
            return x

    captured = _blocks(Gapped(), torch.zeros(2, 8))
    (group,) = captured.blocks
    assert all(captured.body[start].target is torch.nn.functional.layer_norm for start, _ in group)


def test_groups_back_to_back_or_at_the_graph_edges_are_not_rotated() -> None:
    # An encoder's layers, then a decoder's, with nothing around them: rotated, the encoder's
    # first head and the decoder's first head (after the cut between the groups) would be
    # pieces of a LayerNorm alone. Both groups stay their layers.
    class Enc(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln, self.lin = nn.LayerNorm(16), nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.lin(self.ln(x))

    class Dec(Enc):
        def __init__(self) -> None:
            super().__init__()
            self.out = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.out(torch.relu(self.lin(self.ln(x))))

    class EncDec(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc = nn.ModuleList(Enc() for _ in range(3))
            self.dec = nn.ModuleList(Dec() for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in [*self.enc, *self.dec]:
                x = layer(x)
            return x

    captured = _blocks(EncDec(), torch.zeros(2, 16))
    enc, dec = captured.blocks
    assert enc[0][0] == 0 and enc[-1][1] == dec[0][0] and dec[-1][1] == len(captured.body), captured.blocks
    assert len(enc) == len(dec) == 3
    for start, _ in (*enc, *dec):
        assert captured.body[start].target is torch.nn.functional.layer_norm, captured.body[start]


def test_a_head_of_views_is_not_rotated() -> None:
    # A post-LN layer (batch-first attention first): its head is a transpose, nothing that
    # would fuse with the layer before it, so the ranges stay the layers (all three reused).
    class PostLN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
            self.ln = nn.LayerNorm(16)
            self.ff = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.ln(x + self.attn(x, x, x, need_weights=False)[0])
            return x + self.ff(x)

    model = nn.Sequential(*(PostLN() for _ in range(3)))
    captured = _blocks(model, torch.zeros(2, 4, 16))
    (group,) = captured.blocks
    assert len(group) == 3
    assert group[0][0] == 0  # the first layer's range starts at the graph's first node
    for start, stop in group:
        assert captured.body[start].target == "transpose", captured.body[start]
        assert captured.body[stop - 1].target is operator.add, captured.body[stop - 1]


def test_groups_by_class_and_container_and_checkpointed_blocks() -> None:
    captured = _blocks(Repeats(), torch.zeros(8, 64))
    assert [len(g) for g in captured.blocks] == [3, 3]  # layers 0, 2, 3 (not the _Mix); tail 0-2


def test_leaf_modules_of_a_sequential_are_not_blocks() -> None:
    # Sequential(Linear, ReLU) children are blocks; a bare Linear/ReLU chain has none.
    assert len(_blocks(mlp_seq(), torch.zeros(2, 64)).blocks) == 1
    chain = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU())
    assert _blocks(chain, torch.zeros(2, 8)).blocks == ()
