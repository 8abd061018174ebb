"""The Hugging Face Trainer: distcompile compiles the model the Trainer prepares.

torchrun --standalone --nproc-per-node 2 examples/integrations/with_hf_trainer.py
"""

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from distcompile.integrations import hf_trainer

model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32))
data = [{"input_ids": x, "labels": x} for x in torch.randint(0, 128, (64, 32))]
args = TrainingArguments(
    output_dir="runs/ckpt/hf_trainer",
    per_device_train_batch_size=4,
    gradient_accumulation_steps=2,
    max_steps=4,
    save_steps=2,  # resume with trainer.train(resume_from_checkpoint=True)
    report_to=[],
    use_cpu=not torch.cuda.is_available(),  # without a GPU, several processes need use_cpu
)
trainer = Trainer(model=model, args=args, train_dataset=data)
hf_trainer.enable(trainer, backend="inductor")  # before train()
result = trainer.train()
trainer.save_model("runs/ckpt/hf_trainer/final")  # GPT2LMHeadModel.from_pretrained loads it
if trainer.is_world_process_zero():
    print(f"loss {result.training_loss:.3f} after {result.global_step} steps")
