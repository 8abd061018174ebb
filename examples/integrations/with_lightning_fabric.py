"""Lightning Fabric: `strategy=DistCompileFabricStrategy(...)` in place of `strategy="ddp"`.

torchrun --standalone --nproc-per-node 2 examples/integrations/with_lightning_fabric.py
"""

import torch
from lightning_fabric import Fabric
from transformers import GPT2Config, GPT2LMHeadModel

from distcompile.integrations.lightning_strategies import DistCompileFabricStrategy

fabric = Fabric(devices=2, strategy=DistCompileFabricStrategy(backend="inductor"))
fabric.launch()
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, opt = fabric.setup(model, opt)
data = fabric.setup_dataloaders(torch.utils.data.DataLoader(torch.randint(0, 128, (64, 32)), batch_size=4))

for i, x in enumerate(data):
    accumulating = i % 2 == 0  # 2 micro-batches per optimizer step
    with fabric.no_backward_sync(model, enabled=accumulating):
        loss = model(input_ids=x, labels=x).loss
        fabric.backward(loss)
    if not accumulating:
        opt.step()
        opt.zero_grad()

fabric.save("runs/ckpt/fabric.ckpt", {"model": model, "opt": opt})  # the model's plain state dict
fabric.print(f"loss {loss.item():.3f}")
