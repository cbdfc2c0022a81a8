"""Megatron-Core GPT with DACP attention over Skrull's packed per-rank token stream.

Input format: one CP rank's packed micro-batch, batch dimension 1, sequence = the tokens
this rank holds (its local samples whole and its zigzag shards of the distributed ones).

How the pieces reach the attention (explicit, per micro-batch, no global state):

* The training loop builds a :class:`SkrullPackedSeqParams` -- mcore's ``PackedSeqParams``
  with ``qkv_format="sbhd"`` plus this rank's ``layout`` and ``cp_group`` -- and passes it as
  ``packed_seq_params`` to ``GPTModel.forward``.  mcore hands it unchanged to every
  ``core_attention`` call.  ``"sbhd"`` (not ``"thd"``) keeps mcore from squeezing the batch
  dim and from its THD RoPE path, whose CP slicing assumes every sample is zigzag-sharded.
* RoPE: :class:`SkrullGPTModel` overrides ``_preprocess`` to build the rotary table from the
  *global position ids* passed to ``forward`` (restarting at 0 per sample, shards keeping
  their global positions), one row per packed token: ``[T, 1, 1, rot_dim]``.  mcore's
  SelfAttention then applies it with its plain per-token (bshd) RoPE; its CP slicing
  (``RotaryEmbedding.forward`` / ``get_pos_emb_on_this_cp_rank``) is never called.
* :class:`SkrullCoreAttention` (the layer spec's ``core_attention``) receives q/k/v as
  ``[T, 1, heads, head_dim]`` and calls ``dacp_attention(q, k, v, layout, cp_group)``.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from skrull_ext.attention import dacp_attention
from skrull_ext.attention.layout import RankLayout

from megatron.skrull.arguments import ModelArgs

AttentionFn = Callable[..., torch.Tensor]


@dataclasses.dataclass
class SkrullPackedSeqParams(PackedSeqParams):
    """mcore ``PackedSeqParams`` carrying this rank's layout for one micro-batch.

    Attributes:
        layout: :class:`skrull_ext.attention.layout.RankLayout` of this CP rank.
        cp_group: CP process group the attention communicates over (inherited field).
        attention_backend: ``backend`` argument of ``dacp_attention`` (a kernel name
            of ``--skrull-attention-kernel`` or an instance; None: ``$SKRULL_ATTENTION_KERNEL``,
            else ``auto``).
    """

    layout: Optional[RankLayout] = None
    attention_backend: Optional[Any] = None

    def __post_init__(self) -> None:
        if self.qkv_format is None:
            self.qkv_format = "sbhd"
        if self.qkv_format != "sbhd":
            raise ValueError("SkrullPackedSeqParams must use qkv_format='sbhd' (batch dim 1); "
                             "mcore's 'thd' path would re-slice RoPE for CP")
        if self.layout is None:
            raise ValueError("SkrullPackedSeqParams needs the rank's layout")


class SkrullCoreAttention(MegatronModule):
    """``core_attention`` for mcore's SelfAttention that runs DACP attention.

    Constructed by mcore with DotProductAttention's keyword arguments; dropout inside
    attention is not supported (SFT runs without it).
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type,
                 attention_type: str, attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None,
                 pg_collection=None, attention_fn: Optional[AttentionFn] = None):
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError("SkrullCoreAttention has no attention dropout; set "
                             "attention_dropout=0")
        self.layer_number = layer_number
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1 / math.sqrt(head_dim)
        self._attention_fn = attention_fn or dacp_attention

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type=None,
                attention_bias=None, packed_seq_params: Optional[SkrullPackedSeqParams] = None
                ) -> torch.Tensor:
        """Per-document causal attention of the packed stream.

        Args:
            query: ``[T, 1, heads, head_dim]`` (heads of this TP rank).
            key: ``[T, 1, kv_heads, head_dim]``.
            value: ``[T, 1, kv_heads, head_dim]``.
            attention_mask: Ignored (the layout defines the mask).
            packed_seq_params: :class:`SkrullPackedSeqParams` of this micro-batch.

        Returns:
            ``[T, 1, heads * head_dim]``.
        """
        if not isinstance(packed_seq_params, SkrullPackedSeqParams):
            raise ValueError("SkrullCoreAttention needs packed_seq_params=SkrullPackedSeqParams")
        if query.shape[1] != 1:
            raise ValueError(f"packed input must have batch dim 1, got {query.shape[1]}")
        out = self._attention_fn(query[:, 0], key[:, 0], value[:, 0], packed_seq_params.layout,
                                 packed_seq_params.cp_group, softmax_scale=self.softmax_scale,
                                 backend=packed_seq_params.attention_backend)
        return out.reshape(out.shape[0], 1, -1)


class SkrullGPTModel(GPTModel):
    """``GPTModel`` whose RoPE uses the packed stream's global position ids.

    ``forward(input_ids [1, T], position_ids [1, T], attention_mask=None, labels=[1, T],
    packed_seq_params=SkrullPackedSeqParams(...))`` returns the per-token loss ``[1, T]``
    (or logits ``[1, T, vocab/tp]`` without labels), exactly as ``GPTModel``.
    """

    def _preprocess(self, input_ids, position_ids, decoder_input=None, inference_context=None,
                    packed_seq_params=None, padding_mask=None):
        if inference_context is not None:
            raise NotImplementedError("SkrullGPTModel is a training model (no inference context)")
        if not isinstance(packed_seq_params, SkrullPackedSeqParams):
            raise ValueError("SkrullGPTModel.forward needs packed_seq_params="
                             "SkrullPackedSeqParams(layout=..., cp_group=...)")
        if decoder_input is None and self.pre_process:
            decoder_input = self.embedding(input_ids=input_ids, position_ids=position_ids)
        rotary = self.rotary_table(position_ids.reshape(-1))
        return decoder_input, rotary, None, None, None, padding_mask

    def rotary_table(self, positions: torch.Tensor) -> torch.Tensor:
        """RoPE angles of every packed token, laid out like ``RotaryEmbedding.get_emb``.

        Args:
            positions: ``[T]`` int64 position of each token inside its sample.

        Returns:
            ``[T, 1, 1, rot_dim]`` float32 angles (row ``i`` = ``get_emb(n)[positions[i]]``).
        """
        rope = self.rotary_pos_emb
        inv_freq = rope.inv_freq.to(positions.device)
        pos = positions.to(inv_freq.dtype)
        if rope.seq_len_interpolation_factor is not None:
            pos = pos * (1 / rope.seq_len_interpolation_factor)
        freqs = torch.outer(pos, inv_freq)
        if rope.rotary_interleaved:
            emb = torch.stack((freqs, freqs), dim=-1).reshape(freqs.shape[0], -1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb[:, None, None, :]


def transformer_config(args: ModelArgs, *, tp_size: int, cp_size: int, dtype: torch.dtype,
                       use_cpu_initialization: bool) -> TransformerConfig:
    """mcore ``TransformerConfig`` for ``args`` (parameters in ``dtype``)."""
    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.query_groups,
        kv_channels=args.head_dim, ffn_hidden_size=args.ffn_size,
        tensor_model_parallel_size=tp_size, context_parallel_size=cp_size,
        normalization=args.normalization, layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=args.swiglu, activation_func=F.silu if args.swiglu else F.gelu,
        add_bias_linear=not args.disable_bias_linear, add_qkv_bias=args.add_qkv_bias,
        qk_layernorm=args.qk_layernorm,
        hidden_dropout=args.hidden_dropout, attention_dropout=0.0,
        init_method_std=args.init_method_std, params_dtype=dtype, pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        use_cpu_initialization=use_cpu_initialization,
        # Loss = sum of token losses / loss tokens of the global batch (docs/training.md):
        # mcore's DDP sums gradients and finalize_model_grads divides by the token count.
        calculate_per_token_loss=True,
        # Packed micro-batches differ in length (the scheduler fills a token bucket).
        # (mcore rejects it with the default MoE dispatcher "allgather"; the model is dense.)
        variable_seq_lengths=True, moe_token_dispatcher_type="alltoall",
        # Fused kernels need apex/TE/CUDA; the unfused paths are exact.
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
    )


def layer_spec(args: ModelArgs, attention_fn: Optional[AttentionFn] = None) -> ModuleSpec:
    """mcore's local GPT layer spec with :class:`SkrullCoreAttention` as ``core_attention``."""
    spec = get_gpt_layer_local_spec(normalization=args.normalization,
                                    qk_layernorm=args.qk_layernorm)
    attn = spec.submodules.self_attention
    attn.submodules.core_attention = ModuleSpec(
        module=SkrullCoreAttention, params={"attention_fn": attention_fn})
    return spec


def build_model(args: ModelArgs, *, vocab_size: int, tp_size: int = 1, cp_size: int = 1,
                dtype: torch.dtype = torch.float32, device: torch.device = torch.device("cpu"),
                attention_fn: Optional[AttentionFn] = None) -> SkrullGPTModel:
    """Builds the model on ``device`` (parallel state must be initialised).

    Args:
        args: Architecture.
        vocab_size: Padded vocabulary size (divisible by ``tp_size``).
        tp_size: Tensor-parallel size (must match ``parallel_state``).
        cp_size: Context-parallel size (must match ``parallel_state``).
        dtype: Parameter dtype (float32, bfloat16/float16 with fp32 main params in the
            optimizer, float64 in parity tests).
        device: Where the parameters live; CPU initialisation is used on CPU.
        attention_fn: Replacement of ``skrull_ext.attention.dacp_attention`` (same
            signature; tests wrap it to record calls).
    """
    cpu = device.type == "cpu"
    config = transformer_config(args, tp_size=tp_size, cp_size=cp_size, dtype=dtype,
                                use_cpu_initialization=cpu)
    model = SkrullGPTModel(
        config=config, transformer_layer_spec=layer_spec(args, attention_fn),
        vocab_size=vocab_size, max_sequence_length=args.max_position_embeddings,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type="rope", rotary_base=args.rotary_base, parallel_output=True)
    # mcore's torch norms ignore params_dtype; cast everything to one dtype.
    return model.to(device=device, dtype=dtype)
