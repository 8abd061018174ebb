"""Hugging Face models from tiny random configs (no downloads), and the rank function that trains
each under eager DDP and under distcompile's defaults side by side (tests/integrations/test_model_zoo.py).

Dropout is off in every config: Inductor draws its own random numbers by design, so a model
with dropout differs from eager DDP by its masks; ``verify`` and ``doctor`` compare those
with eager's generator instead (docs/debugging.md).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import distcompile
from tests.models import step_each

VOCAB = 128
Batch = Callable[[int, int], dict]  # (rank, step) -> the model's keyword inputs


def _gen(rank: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(1000 * step + rank)


def _tokens(rank: int, step: int, length: int = 16) -> torch.Tensor:
    return torch.randint(1, VOCAB, (4, length), generator=_gen(rank, step))


def _causal(rank: int, step: int) -> dict:
    ids = _tokens(rank, step)
    return {"input_ids": ids, "labels": ids}


def _varying(rank: int, step: int) -> dict:
    ids = _tokens(rank, step, (16, 12, 16, 10)[step % 4])  # a new length recompiles once as dynamic
    return {"input_ids": ids, "labels": ids}


def _padded_mlm(rank: int, step: int) -> dict:
    ids = _tokens(rank, step)
    mask = torch.ones_like(ids)
    mask[1:, 12:] = 0  # three padded rows
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _seq2seq(rank: int, step: int) -> dict:
    return {"input_ids": _tokens(rank, step), "labels": _tokens(rank, step + 100, 8)}


def _images(rank: int, step: int) -> dict:
    g = _gen(rank, step)
    return {
        "pixel_values": torch.randn(4, 3, 32, 32, generator=g),
        "labels": torch.randint(0, 10, (4,), generator=g),
    }


def _audio(rank: int, step: int) -> dict:
    g = _gen(rank, step)
    return {"input_features": torch.randn(4, 16, 32, generator=g), "labels": _tokens(rank, step + 100, 8)}


def _build(name: str) -> tuple[nn.Module, Batch, dict]:
    """The model, its batches, and the DDP options eager DDP needs for it."""
    import transformers as tf

    small = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
    heads = {"num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
    moe = {"num_local_experts": 4, "num_experts_per_tok": 2}
    if name == "bert":
        cfg = tf.BertConfig(
            **small, num_attention_heads=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
        )
        return tf.BertForMaskedLM(cfg), _padded_mlm, {}
    if name == "gpt2":
        cfg = tf.GPT2Config(
            vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
        )
        return tf.GPT2LMHeadModel(cfg), _causal, {}
    if name in ("llama_tied", "llama_untied"):
        cfg = tf.LlamaConfig(**small, **heads, tie_word_embeddings=name == "llama_tied")
        return tf.LlamaForCausalLM(cfg), _varying, {}
    # "_eager": transformers' loop over the experts that received tokens, which differ per rank
    # (Note [Graphs that differ by data]); eager DDP needs find_unused_parameters for it.
    eager = {"experts_implementation": "eager"} if name.endswith("_eager") else {}
    unused = {"find_unused_parameters": True} if eager else {}
    if name.startswith("mixtral"):
        cfg = tf.MixtralConfig(**small, **heads, **moe)
        return tf.MixtralForCausalLM._from_config(cfg, **eager), _causal, unused
    if name.startswith("qwen2_moe"):
        cfg = tf.Qwen2MoeConfig(
            **small,
            **heads,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
        )
        return tf.Qwen2MoeForCausalLM._from_config(cfg, **eager), _causal, unused
    if name == "t5":
        cfg = tf.T5Config(
            vocab_size=VOCAB,
            d_model=64,
            d_kv=16,
            d_ff=128,
            num_layers=2,
            num_heads=4,
            dropout_rate=0.0,
            decoder_start_token_id=0,
        )
        return tf.T5ForConditionalGeneration(cfg), _seq2seq, {}
    if name == "switch":
        cfg = tf.SwitchTransformersConfig(
            vocab_size=VOCAB,
            d_model=64,
            d_kv=16,
            d_ff=128,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=4,
            num_experts=4,
            dropout_rate=0.0,
            decoder_start_token_id=0,
        )
        return tf.SwitchTransformersForConditionalGeneration(cfg), _seq2seq, {"find_unused_parameters": True}
    if name == "vit":
        cfg = tf.ViTConfig(
            image_size=32,
            patch_size=8,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            num_labels=10,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        return tf.ViTForImageClassification(cfg), _images, {}
    if name == "resnet":
        cfg = tf.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10)
        return tf.ResNetForImageClassification(cfg), _images, {}
    if name == "whisper":
        cfg = tf.WhisperConfig(
            vocab_size=VOCAB,
            d_model=64,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=128,
            decoder_ffn_dim=128,
            num_mel_bins=16,
            max_source_positions=16,
            max_target_positions=32,
            dropout=0.0,
            decoder_start_token_id=1,
            pad_token_id=0,
        )
        return tf.WhisperForConditionalGeneration(cfg), _audio, {}
    raise KeyError(name)


def zoo_parity(rank: int, world: int, name: str, checkpointing: bool, steps: int = 4) -> dict:
    """Eager DDP and ``distcompile.wrap(DDP(model))`` (defaults: Inductor, regions) trained side by
    side with AdamW; per-step losses, final parameters and buffers of both."""
    torch.manual_seed(0)
    base, make_batch, ddp_options = _build(name)
    base.train()
    if checkpointing:
        base.gradient_checkpointing_enable()
    ref = DDP(copy.deepcopy(base), **ddp_options)
    ours = distcompile.wrap(DDP(copy.deepcopy(base), **ddp_options))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ref, ours)]
    losses = []
    for step in range(steps):
        losses.append(
            step_each((ref, ours), opts, lambda model, step=step: model(**make_batch(rank, step)).loss)
        )
    out = {
        "losses": np.array(losses),
        "params": {n: p.detach().numpy().copy() for n, p in ours.module.named_parameters()},
        "ref_params": {n: p.detach().numpy().copy() for n, p in ref.module.named_parameters()},
        "buffers": {n: b.detach().float().numpy().copy() for n, b in ours.module.named_buffers()},
        "ref_buffers": {n: b.detach().float().numpy().copy() for n, b in ref.module.named_buffers()},
        "graphs": len(ours.graphs),
        "regions_kept": ours._unmark is not None,
    }
    ours.close()
    return out


def gpt2_dynamic(rank: int, world: int, backend: str) -> dict:
    """HF GPT-2 under ``wrap(..., dynamic=True)``, sequence lengths 16, 12, 9, 14, graphs cut into
    8 pieces (a small bucket cap): its GELU's ``math.sqrt(2 / math.pi)`` is a symbolic float."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    base = tf.GPT2LMHeadModel(cfg).train()
    ref = DDP(copy.deepcopy(base), bucket_cap_mb=0.05)
    ours = distcompile.wrap(DDP(copy.deepcopy(base), bucket_cap_mb=0.05), backend=backend, dynamic=True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ref, ours)]
    losses = []
    for step, n in enumerate((16, 12, 9, 14)):
        ids = _tokens(rank, step, n)
        losses.append(
            step_each((ref, ours), opts, lambda model, ids=ids: model(input_ids=ids, labels=ids).loss)
        )
    out = {
        "losses": np.array(losses),
        "params": {n: p.detach().numpy().copy() for n, p in ours.module.named_parameters()},
        "ref_params": {n: p.detach().numpy().copy() for n, p in ref.module.named_parameters()},
        "graphs": len(ours.graphs),
        "pieces": [len(g.plan.compiled_pieces) for g in ours.graphs],
    }
    ours.close()
    return out
