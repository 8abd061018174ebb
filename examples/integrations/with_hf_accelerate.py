"""Accelerate: `prepare` builds the DDP model, distcompile compiles it.

torchrun --standalone --nproc-per-node 2 examples/integrations/with_hf_accelerate.py
"""

import torch
from accelerate import Accelerator
from transformers import GPT2Config, GPT2LMHeadModel

from distcompile.integrations import hf_accelerate

# Without a GPU, Accelerate needs cpu=True to run several processes as one job.
accelerator = Accelerator(gradient_accumulation_steps=2, cpu=not torch.cuda.is_available())
hf_accelerate.enable(accelerator, backend="inductor")  # before prepare()

model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = torch.utils.data.DataLoader(torch.randint(0, 128, (64, 32)), batch_size=4)
model, opt, data = accelerator.prepare(model, opt, data)  # model: a DistCompiledModule

for x in data:
    with accelerator.accumulate(model):  # one all-reduce per optimizer step
        loss = model(input_ids=x, labels=x).loss
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()

accelerator.save_state("runs/ckpt/accelerate")  # load_state("runs/ckpt/accelerate") resumes
plain = accelerator.get_state_dict(model)  # the user's model's keys: loads into GPT2LMHeadModel
accelerator.print(f"loss {loss.item():.3f}; {len(plain)} tensors in the plain state dict")
