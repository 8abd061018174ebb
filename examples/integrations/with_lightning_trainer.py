"""Lightning's Trainer: `strategy=DistCompileStrategy(...)` in place of `strategy="ddp"`.

torchrun --standalone --nproc-per-node 2 examples/integrations/with_lightning_trainer.py
"""

import pytorch_lightning as pl
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from distcompile.integrations.lightning_strategies import DistCompileStrategy


class LitGPT(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.net(input_ids=batch, labels=batch).loss
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


trainer = pl.Trainer(
    accelerator="auto",
    devices=2,
    strategy=DistCompileStrategy(backend="inductor"),
    accumulate_grad_batches=2,  # one all-reduce per optimizer step
    max_steps=4,
    default_root_dir="runs/ckpt/lightning",
    logger=False,
)
data = torch.utils.data.DataLoader(torch.randint(0, 128, (64, 32)), batch_size=4)
trainer.fit(LitGPT(), data)  # checkpoints hold the LightningModule's plain state dict
if trainer.is_global_zero:
    print(f"loss {trainer.callback_metrics['loss'].item():.3f} after {trainer.global_step} steps")
