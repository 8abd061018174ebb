"""Training loops run on every rank by the integration tests, each with a stack's own API.

Every loop trains the same tiny GPT-2 (Hugging Face ``transformers``, dropout off so the
runs are comparable) twice: once through the stack's own DDP, once through distcompile,
and returns losses, parameters and what the test checks about checkpoints.
"""

from __future__ import annotations

import os

import torch

import distcompile

VOCAB, SEQ = 96, 16


def _env(rank: int, world: int) -> None:
    # What torchrun exports; the stacks read it (the process group already exists).
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world)
    )
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")


def both(rank: int, world: int, loop, path: str) -> tuple[dict, dict]:  # noqa: ANN001
    """``loop`` with the stack's own DDP, then with distcompile, in one process (one import of the stack)."""
    return loop(rank, world, False, f"{path}-ref"), loop(rank, world, True, f"{path}-ours")


def tiny_gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=SEQ,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(cfg)


def token_batches(rank: int, n: int, batch: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, VOCAB, (batch, SEQ), generator=g) for _ in range(n)]


def accelerate_loop(rank: int, world: int, use_distcompile: bool, ckpt_dir: str) -> dict:
    """``Accelerator`` with ``accumulate`` (2 micro-batches per step), then save/load state."""
    _env(rank, world)
    from accelerate import Accelerator

    from distcompile.integrations import hf_accelerate as dc_accelerate

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    if use_distcompile:
        dc_accelerate.enable(accelerator, backend="aot_eager")
    model = tiny_gpt2()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = accelerator.prepare(model, opt)
    losses = []
    for x in token_batches(rank, 6):
        with accelerator.accumulate(model):
            loss = model(input_ids=x, labels=x).loss
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    accelerator.save_state(ckpt_dir)
    accelerator.wait_for_everyone()  # rank 0 writes; every rank reads
    before = {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    accelerator.load_state(ckpt_dir)
    plain = accelerator.get_state_dict(model)
    out = {
        "losses": losses,
        "params": [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()],
        "unwrapped": type(accelerator.unwrap_model(model)).__name__,
        "plain_keys_load": _loads_into_plain(plain),
        "restored": all(
            torch.equal(before[k], v) for k, v in accelerator.unwrap_model(model).state_dict().items()
        ),
        "type": type(model).__name__,
    }
    if use_distcompile:
        out["synced_steps"] = model.last_step.step + 1
        out["buckets"] = [len(g.plan.buckets) for g in model.graphs]
    return out


def _loads_into_plain(state: dict) -> bool:
    fresh = tiny_gpt2()
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    return not unexpected and all(k.endswith("lm_head.weight") for k in missing)


def accelerate_wrong_order(rank: int, world: int) -> str:
    """``wrap`` first, then ``prepare``: Accelerate's DDP ends up around distcompile."""
    _env(rank, world)
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(distcompile.wrap(tiny_gpt2(), backend="eager"))
    x = token_batches(rank, 1)[0]
    try:
        model(input_ids=x, labels=x).loss.backward()
    except distcompile.UnsupportedModelError as e:
        return str(e)
    return "no error"


def _trainer(out_dir: str, rank: int, use_distcompile: bool, max_steps: int):  # noqa: ANN202
    from transformers import Trainer, TrainingArguments

    from distcompile.integrations import hf_trainer as dc_transformers

    data = [{"input_ids": x, "labels": x} for x in token_batches(0, 24, batch=1) for x in x]
    args = TrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=max_steps,
        save_steps=2,
        learning_rate=0.05,
        optim="sgd",
        lr_scheduler_type="constant",
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=data)
    if use_distcompile:
        dc_transformers.enable(trainer, backend="aot_eager")
    return trainer


def hf_trainer_loop(rank: int, world: int, use_distcompile: bool, out_dir: str) -> dict:
    """``Trainer.train`` (3 steps of 2 accumulated micro-batches), then a resume from step 2."""
    _env(rank, world)
    from transformers import GPT2LMHeadModel

    trainer = _trainer(out_dir, rank, use_distcompile, max_steps=3)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    final = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.save_model(os.path.join(out_dir, "final"))
    trainer.accelerator.wait_for_everyone()
    resumed = _trainer(out_dir, rank, use_distcompile, max_steps=3)
    resumed.train(resume_from_checkpoint=os.path.join(out_dir, "checkpoint-2"))
    out = {
        "losses": losses,
        "params": final,
        "resumed_params": [p.detach().clone() for p in resumed.model.parameters()],
        "plain_load": [
            p.detach().clone()
            for p in GPT2LMHeadModel.from_pretrained(os.path.join(out_dir, "final")).parameters()
        ],
        "type": type(trainer.model_wrapped).__name__,
    }
    if use_distcompile:
        out["synced_steps"] = trainer.model_wrapped.last_step.step + 1
    return out


def fabric_loop(rank: int, world: int, use_distcompile: bool, ckpt: str) -> dict:
    """``Fabric``: setup, ``no_backward_sync`` on the first of 2 micro-batches, save and load."""
    _env(rank, world)
    from lightning_fabric import Fabric

    from distcompile.integrations.lightning_strategies import DistCompileFabricStrategy

    strategy = DistCompileFabricStrategy(backend="aot_eager") if use_distcompile else "ddp"
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    module = tiny_gpt2()
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    model, opt = fabric.setup(module, opt)
    losses = []
    for i, x in enumerate(token_batches(rank, 6)):
        with fabric.no_backward_sync(model, enabled=i % 2 == 0):
            loss = model(input_ids=x, labels=x).loss
            fabric.backward(loss)
        losses.append(loss.item())
        if i % 2 == 1:
            opt.step()
            opt.zero_grad()
    fabric.save(ckpt, {"model": model, "opt": opt})
    fabric.barrier()
    saved = [p.detach().clone() for p in module.parameters()]
    with torch.no_grad():
        for p in module.parameters():
            p.zero_()
    fabric.load(ckpt, {"model": model, "opt": opt})
    out = {
        "restored": all(torch.equal(a, b) for a, b in zip(saved, module.parameters())),
        "losses": losses,
        "params": [p.detach().clone() for p in module.parameters()],
        "plain_keys_load": _loads_into_plain(torch.load(ckpt, weights_only=True)["model"]),
    }
    if use_distcompile:
        out["synced_steps"] = model._forward_module.last_step.step + 1
    return out


def lightning_trainer_loop(rank: int, world: int, use_distcompile: bool, out_dir: str) -> dict:
    """Lightning's ``Trainer``: 3 steps of 2 accumulated batches, a checkpoint, a plain reload."""
    _env(rank, world)
    import pytorch_lightning as pl

    from distcompile.integrations.lightning_strategies import DistCompileStrategy

    class LitGPT(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = tiny_gpt2()
            self.losses: list[float] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(input_ids=x, labels=x).loss

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            loss = self(batch)
            self.log("loss", loss)
            return loss

        def on_train_batch_end(self, outputs: dict, batch: torch.Tensor, batch_idx: int) -> None:
            self.losses.append(outputs["loss"].item())

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    lit = LitGPT()
    strategy = DistCompileStrategy(backend="aot_eager") if use_distcompile else "ddp"
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=3,
        accumulate_grad_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out_dir,
        use_distributed_sampler=False,
    )
    batches = token_batches(rank, 6)
    trainer.fit(lit, torch.utils.data.DataLoader(batches, batch_size=None))
    ckpt = os.path.join(out_dir, "final.ckpt")
    trainer.save_checkpoint(ckpt)
    trainer.strategy.barrier()
    state = {k.removeprefix("net."): v for k, v in torch.load(ckpt, weights_only=False)["state_dict"].items()}
    out = {
        "losses": lit.losses,
        "params": [p.detach().clone() for p in lit.net.parameters()],
        "plain_keys_load": _loads_into_plain(state),
    }
    if use_distcompile:
        out["synced_steps"] = trainer.strategy.distcompile_model.last_step.step + 1
        out["graphs"] = len(trainer.strategy.distcompile_model.graphs)
    return out


def accelerate_enable_late(rank: int, world: int, when: str) -> str:
    """``enable()`` after ``prepare()`` (``when="after_prepare"``), or twice with other options
    (``"twice"``): each must raise, not train on silently under Accelerate's own DDP."""
    _env(rank, world)
    from accelerate import Accelerator

    from distcompile.integrations import hf_accelerate

    accelerator = Accelerator(cpu=True)
    try:
        if when == "after_prepare":
            accelerator.prepare(tiny_gpt2())
            hf_accelerate.enable(accelerator, backend="eager")
        else:
            hf_accelerate.enable(accelerator, backend="eager")
            hf_accelerate.enable(accelerator, backend="eager")  # the same options: accepted
            hf_accelerate.enable(accelerator, backend="aot_eager")
    except distcompile.ConfigError as e:
        return str(e)
    return "no error"


def trainer_enable_after_train(rank: int, world: int, out_dir: str) -> str:
    """``hf_trainer.enable(trainer)`` after a first ``trainer.train()``."""
    _env(rank, world)
    from distcompile.integrations import hf_trainer as dc_transformers

    trainer = _trainer(out_dir, rank, False, max_steps=1)
    trainer.train()
    try:
        dc_transformers.enable(trainer, backend="eager")
    except distcompile.ConfigError as e:
        return str(e)
    return "no error"


def lightning_fit_recompiles(rank: int, world: int, use_distcompile: bool, out_dir: str) -> dict:
    """Two ``fit``s of two epochs each, with validation every epoch (its last batch smaller) and
    ``self.log`` in both steps: what each fit compiles, and how long it takes."""
    import time

    _env(rank, world)
    import pytorch_lightning as pl

    from distcompile.integrations.lightning_strategies import DistCompileStrategy

    class LitGPT(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = tiny_gpt2()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(input_ids=x, labels=x).loss

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            loss = self(batch)
            self.log("loss", loss)
            return loss

        def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
            self.log("val_loss", self(batch), sync_dist=True)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    lit = LitGPT()
    train = token_batches(rank, 4)
    val = token_batches(rank + 10, 3)[:2] + [token_batches(rank + 20, 1, batch=2)[0]]  # last batch: 2 rows
    fits = []
    for _ in range(2):
        strategy = DistCompileStrategy(backend="aot_eager") if use_distcompile else "ddp"
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=world,
            strategy=strategy,
            max_epochs=2,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            default_root_dir=out_dir,
            use_distributed_sampler=False,
        )
        start = time.perf_counter()
        trainer.fit(
            lit,
            torch.utils.data.DataLoader(train, batch_size=None),
            torch.utils.data.DataLoader(val, batch_size=None),
        )
        fit = {"seconds": time.perf_counter() - start}
        if use_distcompile:
            graphs = trainer.strategy.distcompile_model.graphs
            fit["graphs"] = len(graphs)
            fit["recompiles"] = [g.recompile_reason for g in graphs if g.recompile_reason]
            fit["compile_s"] = sum(g.compile_s for g in graphs)
        fits.append(fit)
    return {"fits": fits, "params": [p.detach().clone() for p in lit.net.parameters()]}
