"""The Hugging Face transformers side of ``bench_gpu.py``: the same model and batches.

``Qwen2ForCausalLM`` from a ``Qwen2Config`` of the launcher's shape (QKV bias, SwiGLU,
RMSNorm, RoPE base, tied embeddings, the padded vocabulary), fp32 weights trained under
``torch.autocast`` bf16 on CUDA (what the HF Trainer does with ``bf16=True``), AdamW
(fused on CUDA) with the launcher's defaults, gradient clipping 1.0.  Labels follow the
launcher's loss mask: transformers shifts labels itself, so position ``t + 1`` carries the
target of position ``t`` where the mask is 1, else -100 (documents never predict across
their boundary).  Each micro-batch's mean loss is weighted by its share of the global
batch's loss tokens, so the gradient is the launcher's (sum of token losses / loss tokens).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

ATTN = ("sdpa", "eager", "flash_attention_2", "flex_attention")


def unavailable(attn: str, device: torch.device) -> Optional[str]:
    """Why ``attn_implementation=attn`` cannot run here, or ``None``."""
    if attn not in ATTN:
        return f"unknown attn_implementation (use one of {', '.join(ATTN)})"
    if attn == "flash_attention_2":
        from transformers.utils import is_flash_attn_2_available

        if device.type != "cuda" or not is_flash_attn_2_available():
            return "flash-attn is not installed (or no CUDA)"
    return None


def _doc(sample) -> tuple[np.ndarray, np.ndarray]:
    """``(input ids, transformers labels)`` of one document."""
    hf = np.full(len(sample.tokens), -100, dtype=np.int64)
    hf[1:] = np.where(sample.loss_mask[:-1] > 0, sample.labels[:-1], -100)
    return np.asarray(sample.tokens, dtype=np.int64), hf


def packed_inputs(source, batches, plans, device) -> list[list[list]]:
    """Per global batch, per micro-batch of its plan (CP = 1: every sample local), the
    documents as ``(input ids, labels)`` on ``device``; the scheduler's packing reused."""
    out = []
    for ids, plan in zip(batches, plans):
        mbs = []
        for mb in plan.dp_ranks[0]:
            docs = [_doc(source.sample(int(ids[s]))) for s in mb.samples()]
            mbs.append([(torch.from_numpy(t).to(device), torch.from_numpy(lab).to(device))
                        for t, lab in docs])
        out.append(mbs)
    return out


def build_model(cfg, vocab: int, attn: str, device, checkpointing: bool):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    m = cfg.model
    config = Qwen2Config(vocab_size=vocab, hidden_size=m.hidden_size,
                         intermediate_size=m.ffn_size, num_hidden_layers=m.num_layers,
                         num_attention_heads=m.num_attention_heads,
                         num_key_value_heads=m.query_groups,
                         max_position_embeddings=m.max_position_embeddings,
                         rope_theta=float(m.rotary_base), rms_norm_eps=m.norm_epsilon,
                         tie_word_embeddings=not m.untie_embeddings_and_output_weights,
                         use_cache=False)
    config._attn_implementation = attn
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def _inputs(docs, mode: str) -> list[dict]:
    """Forward inputs of one micro-batch: one packed sequence, or one per document."""
    if mode == "per-doc":
        return [dict(input_ids=t[None], labels=lab[None]) for t, lab in docs]
    if mode != "packed":
        raise ValueError(f"--hf-modes: unknown mode {mode!r}; use packed or per-doc")
    pos = torch.cat([torch.arange(len(t), device=t.device) for t, _ in docs])
    return [dict(input_ids=torch.cat([t for t, _ in docs])[None], position_ids=pos[None],
                 labels=torch.cat([lab for _, lab in docs])[None])]


def run(cfg, vocab: int, attn: str, mode: str, packs, device, checkpointing: bool,
        deadline: float) -> tuple[float, int]:
    """``(seconds, iterations)`` of training ``packs[1:]`` after ``packs[0]`` (warm-up)."""
    from gpu_common import free_memory, timed

    model = build_model(cfg, vocab, attn, device, checkpointing)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.01, betas=(0.9, 0.999), eps=1e-8,
                            fused=device.type == "cuda")
    amp = device.type == "cuda" and cfg.bf16

    def step(batch):
        items = [x for mb in batch for x in _inputs(mb, mode)]
        total = sum(int((x["labels"] >= 0).sum()) for x in items)
        for x in items:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                loss = model(**x).loss
            (loss * (int((x["labels"] >= 0).sum()) / max(total, 1))).backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.optim.clip_grad)
        opt.step()
        opt.zero_grad(set_to_none=True)

    try:
        return timed(step, packs, device, deadline)
    finally:
        del model, opt, params
        free_memory()
