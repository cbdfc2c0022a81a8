"""Megatron-Core GPT with DACP attention over Skrull's packed per-rank token stream.

Input format: one CP rank's packed micro-batch, batch dimension 1, sequence = the tokens
this rank holds (its local samples whole and its zigzag shards of the distributed ones).

Only mcore's public extension points are used (no private method is overridden):

* **Packed-sequence parameters.**  The training loop builds a :class:`SkrullPackedSeqParams`
  -- mcore's ``PackedSeqParams`` in the ``"thd"`` format it was designed for:
  ``cu_seqlens_q/kv`` mark the documents of this rank's stream (local sequences, then
  the shards of the distributed ones), plus this rank's ``layout`` -- and passes it as
  ``packed_seq_params`` to ``GPTModel.forward``.  mcore squeezes the batch dim for
  ``thd`` and hands the object unchanged to every ``core_attention`` call.
* **Layer spec.**  :func:`layer_spec` is mcore's local GPT spec with
  :class:`SkrullCoreAttention` as the ``core_attention`` submodule.  It receives q/k/v as
  ``[T, heads, head_dim]``, applies RoPE at the layout's *global* position ids
  (restarting at 0 per sample, shards keeping their global positions) as mcore's
  unfused ``apply_rotary_pos_emb`` does (:func:`apply_rope`), and calls
  ``dacp_attention(q, k, v, layout, cp_group)``.
* **RoPE.**  The model is a plain ``GPTModel`` built with ``position_embedding_type="none"``
  so mcore computes no rotary table of its own: its table is indexed by stream row and
  its THD path re-slices every document for CP as if each were zigzag-sharded, neither
  of which holds for Skrull's mix of whole local and sharded distributed documents.
  The frequencies (plain, ``linear``, ``llama3`` or ``yarn`` scaled:
  :mod:`megatron.skrull.rope`) equal mcore's and transformers'; the table of a micro-batch,
  its cos and sin, are built once and shared by every layer.  YaRN's attention factor
  multiplies cos and sin (mcore's ``mscale``, transformers' ``attention_scaling``), so q
  and k reach every DACP kernel already scaled.  There are no RoPE parameters, so
  checkpoints and Hugging Face weights are those of a ``rope`` GPTModel.
"""
from __future__ import annotations

import dataclasses
import math
import weakref
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from megatron.core.models.common.embeddings.rope_utils import (_rotate_half,
                                                                apply_rotary_pos_emb)
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import (TransformerBlockSubmodules,
                                                         get_num_layers_to_build)
from megatron.core.transformer.transformer_config import TransformerConfig

from skrull_ext.attention import dacp_attention
from skrull_ext.attention.layout import RankLayout
from skrull_ext.attention.meta import staged_positions
from skrull_ext.attention.staging import device_key

from megatron.skrull.arguments import ModelArgs, RecomputeArgs
from megatron.skrull.rope import RopeArgs, RopeFrequencies, rope_args

AttentionFn = Callable[..., torch.Tensor]


@dataclasses.dataclass
class SkrullPackedSeqParams(PackedSeqParams):
    """mcore ``PackedSeqParams`` (``thd``) carrying this rank's layout for one micro-batch.

    ``cu_seqlens_q/kv`` and ``max_seqlen_q/kv`` are filled from ``layout`` when not given:
    the document boundaries of the packed stream (local sequences, then the shards of the
    distributed ones, then those of the grouped ones), as mcore and Transformer Engine define them for ``thd``.

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
            self.qkv_format = "thd"
        if self.qkv_format != "thd":
            raise ValueError("SkrullPackedSeqParams is a packed stream: qkv_format must be 'thd'")
        if self.layout is None:
            raise ValueError("SkrullPackedSeqParams needs the rank's layout")
        if self.cu_seqlens_q is None:
            cu = _stream_offsets(self.layout)
            self.cu_seqlens_q = self.cu_seqlens_kv = torch.tensor(cu, dtype=torch.int32)
            # from the host offsets: no tensor is read back
            longest = max((b - a for a, b in zip(cu[:-1], cu[1:])), default=0)
            self.max_seqlen_q = self.max_seqlen_kv = longest


def _stream_offsets(layout: RankLayout) -> list[int]:
    local = list(layout.local_cu_seqlens)
    dist = [local[-1] + x for x in layout.dist_cu_seqlens[1:]]
    grouped = [g.offset + x for g in layout.groups for x in g.cu_seqlens[1:]]  # hybrid CP
    return local + dist + grouped


def stream_cu_seqlens(layout: RankLayout) -> torch.Tensor:
    """``[docs + 1]`` int32 offsets of every document (or shard) in ``layout``'s stream."""
    return torch.tensor(_stream_offsets(layout), dtype=torch.int32)


# layout -> {(rope id, device): [T, 1, 1, rot_dim] table}; every layer of a micro-batch
# shares one table (weak keys: freed with the layout).
_ROPE_TABLES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def rotary_table(rope: RopeFrequencies, positions: torch.Tensor) -> torch.Tensor:
    """RoPE angles of every packed token, laid out like mcore's ``RotaryEmbedding.get_emb``.

    ``get_emb(n)`` numbers rows ``0..n-1``; a packed stream needs row ``i`` at the
    position of token ``i`` in its own sample, so the angles are computed from positions.

    Args:
        rope: The layer's frequencies.
        positions: ``[T]`` int64 position of each token inside its sample.

    Returns:
        ``[T, 1, 1, rot_dim]`` float32 angles (row ``i`` = ``get_emb(n)[positions[i]]``).
    """
    return rope.angles(positions)


def _layout_rotary_table(rope: RopeFrequencies, rope_key: tuple, layout: RankLayout,
                         device: torch.device) -> torch.Tensor:
    per_layout = _ROPE_TABLES.setdefault(layout, {})
    key = (rope_key, device_key(device))
    if key not in per_layout:
        # Positions staged with the micro-batch (skrull_ext.attention.meta.stage_layout),
        # frequencies moved once per run: no host-to-device copy per micro-batch here.
        positions = staged_positions(layout, device)
        per_layout[key] = rotary_table(_rope_on(rope, key), positions)
    return per_layout[key]


def _layout_cos_sin(rope: RopeFrequencies, rope_key: tuple, layout: RankLayout,
                    device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """``(cos, sin)`` of the micro-batch's angles times the attention factor, in ``dtype``
    (``[T, 1, 1, rot_dim]``): what mcore's unfused RoPE computes from the angle table in
    every call (4 kernels per tensor, layer and pass), once per micro-batch and layers."""
    per_layout = _ROPE_TABLES.setdefault(layout, {})
    key = ("cos_sin", rope_key, device_key(device), dtype)
    if key not in per_layout:
        freqs = _layout_rotary_table(rope, rope_key, layout, device)
        m = rope.attention_factor
        per_layout[key] = ((torch.cos(freqs) * m).to(dtype), (torch.sin(freqs) * m).to(dtype))
    return per_layout[key]


def apply_rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               interleaved: bool = False) -> torch.Tensor:
    """mcore's unfused RoPE (``rope_utils._apply_rotary_pos_emb_bshd``: the same ops in the
    same order, its ``_rotate_half``) with ``cos`` and ``sin`` given instead of recomputed
    from the angles; mcore's public API takes precomputed ones only through flash-attn's
    fused kernel.  Bit-equal to ``apply_rotary_pos_emb`` (tests/test_skrull_model.py).

    Args:
        t: ``[T, 1, heads, dim]``.
        cos, sin: ``[T, 1, 1, rot_dim]`` in ``t.dtype`` (:func:`_layout_cos_sin`).
        interleaved: ``config.rotary_interleaved``.
    """
    rot = cos.shape[-1]
    t, t_pass = t[..., :rot], t[..., rot:]
    t = (t * cos) + (_rotate_half(t, interleaved) * sin)
    return torch.cat((t, t_pass), dim=-1) if t_pass.shape[-1] else t


def _rope_on(rope: RopeFrequencies, key: tuple) -> RopeFrequencies:
    """``rope`` with its frequencies on the device of ``key`` = ``(rope key, device)``,
    moved once per run (the same frequencies for every layer with that rope key)."""
    if key not in _ROPE_ON_DEVICE:
        _ROPE_ON_DEVICE[key] = dataclasses.replace(rope, inv_freq=rope.inv_freq.to(key[1]))
    return _ROPE_ON_DEVICE[key]


_ROPE_ON_DEVICE: dict = {}  # (rope key, device) -> RopeFrequencies on the device


class SkrullCoreAttention(MegatronModule):
    """``core_attention`` for mcore's SelfAttention: RoPE at global positions + DACP.

    Constructed by mcore with DotProductAttention's keyword arguments plus the spec's
    ``params``; dropout inside attention is not supported (SFT runs without it).

    Args:
        rotary_base: RoPE base (``--rotary-base``); ``None`` disables RoPE.
        attention_fn: Replacement of ``dacp_attention`` (tests record calls with it).
        rope: RoPE flags (scaling, ``--rotary-percent``); ``None``: plain RoPE.
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type,
                 attention_type: str, attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None,
                 pg_collection=None, attention_fn: Optional[AttentionFn] = None,
                 rotary_base: Optional[float] = 10000, rope: Optional[RopeArgs] = None):
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError("SkrullCoreAttention has no attention dropout; set "
                             "attention_dropout=0")
        self.layer_number = layer_number
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1 / math.sqrt(head_dim)
        self._attention_fn = attention_fn or dacp_attention
        # Not a submodule: no parameters or buffers (inv_freq is a plain attribute upstream).
        rope = rope or RopeArgs()
        self._rope = None if rotary_base is None else RopeFrequencies.build(
            rope, head_dim, rotary_base, config.rotary_interleaved)
        self._rope_key = (head_dim, rotary_base, config.rotary_interleaved, rope)
        # mcore's unfused bshd RoPE (what apply_rotary_pos_emb runs for this config), with
        # cos and sin computed once per micro-batch (:func:`apply_rope`)
        self._unfused_rope = not (config.apply_rope_fusion or config.multi_latent_attention)

    @property
    def rope(self) -> Optional[RopeFrequencies]:
        """The frequencies (and YaRN's attention factor) this layer applies."""
        return self._rope

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type=None,
                attention_bias=None, packed_seq_params: Optional[SkrullPackedSeqParams] = None
                ) -> torch.Tensor:
        """Per-document causal attention of the packed stream.

        Args:
            query: ``[T, heads, head_dim]`` (heads of this TP rank; ``thd``).
            key: ``[T, kv_heads, head_dim]``.
            value: ``[T, kv_heads, head_dim]``.
            attention_mask: Ignored (the layout defines the mask).
            packed_seq_params: :class:`SkrullPackedSeqParams` of this micro-batch.

        Returns:
            ``[T, heads * head_dim]`` (mcore reshapes it to ``[T, 1, hidden]``).
        """
        if not isinstance(packed_seq_params, SkrullPackedSeqParams):
            raise ValueError("SkrullCoreAttention needs packed_seq_params=SkrullPackedSeqParams")
        if query.dim() != 3:
            raise ValueError(f"packed (thd) q/k/v must be [T, heads, dim], got {query.shape}")
        layout = packed_seq_params.layout
        # Sequence parallelism pads the stream to a multiple of TP with rows past the
        # layout's tokens (micro_batch.pad_micro_batch); they attend to nothing, no real
        # token attends to them, and their output is 0.
        tokens, padding = layout.num_tokens, query.shape[0] - layout.num_tokens
        if padding < 0:
            raise ValueError(f"stream of {query.shape[0]} rows < the layout's {tokens} tokens")
        if padding:
            query, key, value = query[:tokens], key[:tokens], value[:tokens]
        if self._rope is not None and self._unfused_rope:
            cos, sin = _layout_cos_sin(self._rope, self._rope_key, layout, query.device,
                                       query.dtype)
            query, key = (apply_rope(x[:, None], cos, sin, self.config.rotary_interleaved)[:, 0]
                          for x in (query, key))
        elif self._rope is not None:
            freqs = _layout_rotary_table(self._rope, self._rope_key, layout, query.device)
            # mscale: cos and sin times YaRN's attention factor, as transformers does.
            query, key = (apply_rotary_pos_emb(x[:, None], freqs, self.config,
                                               mscale=self._rope.attention_factor,
                                               cp_group=packed_seq_params.cp_group)[:, 0]
                          for x in (query, key))
        out = self._attention_fn(query, key, value, layout, packed_seq_params.cp_group,
                                 softmax_scale=self.softmax_scale,
                                 backend=packed_seq_params.attention_backend)
        out = out.reshape(out.shape[0], -1)
        return F.pad(out, (0, 0, 0, padding)) if padding else out


class SequenceParallelNorm:
    """mcore's ``WrappedTorchNorm`` (torch ``LayerNorm``/``RMSNorm``) usable with SP.

    mcore's local spec uses ``WrappedTorchNorm`` for RMSNorm always and for LayerNorm
    without apex, and it asserts ``not config.sequence_parallel``
    (``megatron/core/transformer/torch_norm.py``): under SP a norm sees only its TP
    rank's slice of the tokens, so its weight gradient is partial and must be summed
    over TP, which ``finalize_model_grads`` does for parameters marked
    ``sequence_parallel`` -- the mark mcore's apex ``FusedLayerNorm`` and TE's ``TENorm``
    set and the torch wrapper does not.  This wrapper builds the same torch module and
    sets the mark (apex and TE cannot be installed here; the math is per token, exact).
    """

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5,
                **_unused) -> torch.nn.Module:
        norm_cls = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        norm = norm_cls(normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def transformer_config(args: ModelArgs, *, tp_size: int, cp_size: int, dtype: torch.dtype,
                       use_cpu_initialization: bool,
                       recompute: Optional[RecomputeArgs] = None,
                       pp_size: int = 1, sequence_parallel: bool = False) -> TransformerConfig:
    """mcore ``TransformerConfig`` for ``args`` (parameters in ``dtype``).

    ``sequence_parallel`` (TP > 1; mcore raises otherwise) splits the tokens between the
    layers' TP regions over TP ranks: the stream must be a multiple of TP long
    (:func:`megatron.skrull.micro_batch.pad_micro_batch`).

    With ``pp_size > 1`` activations between stages have a different token count per
    micro-batch and per CP rank, so P2P first exchanges shapes (``variable_seq_lengths``);
    P2P runs as plain isend/irecv pairs (no batched ops), which gloo and NCCL both run.
    """
    config = TransformerConfig(
        pipeline_model_parallel_size=pp_size, batch_p2p_comm=False,
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.query_groups,
        kv_channels=args.head_dim, ffn_hidden_size=args.ffn_size,
        tensor_model_parallel_size=tp_size, context_parallel_size=cp_size,
        sequence_parallel=sequence_parallel,
        normalization=args.normalization, layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=args.swiglu, activation_func=F.silu if args.swiglu else F.gelu,
        add_bias_linear=not args.disable_bias_linear, add_qkv_bias=args.add_qkv_bias,
        qk_layernorm=args.qk_layernorm,
        hidden_dropout=args.hidden_dropout, attention_dropout=0.0,
        # Recompute: "selective" checkpoints core attention (SkrullCoreAttention: the ring's
        # forward, P2P exchange included, re-runs in backward on every CP rank in the same
        # order); "full" checkpoints whole layers.
        **dataclasses.asdict(recompute or RecomputeArgs()),
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
    # Set after construction: __post_init__ rejects it with the (default) allgather MoE
    # token dispatcher, which a dense model never runs.
    config.variable_seq_lengths = pp_size > 1
    return config


def layer_spec(args: ModelArgs, attention_fn: Optional[AttentionFn] = None,
               sequence_parallel: bool = False) -> ModuleSpec:
    """mcore's local GPT layer spec with :class:`SkrullCoreAttention` as ``core_attention``.

    With ``sequence_parallel`` the torch norms become :class:`SequenceParallelNorm`.
    """
    spec = get_gpt_layer_local_spec(normalization=args.normalization,
                                    qk_layernorm=args.qk_layernorm)
    attn = spec.submodules.self_attention
    attn.submodules.core_attention = ModuleSpec(
        module=SkrullCoreAttention,
        params={"attention_fn": attention_fn, "rotary_base": args.rotary_base,
                "rope": rope_args(args)})
    if sequence_parallel:
        layer = spec.submodules
        for owner, name in ((layer, "input_layernorm"), (layer, "pre_mlp_layernorm"),
                            (attn.submodules, "q_layernorm"), (attn.submodules, "k_layernorm")):
            if getattr(owner, name) is WrappedTorchNorm:
                setattr(owner, name, SequenceParallelNorm)
    return spec


def te_layer_spec(args: ModelArgs, attention_fn: Optional[AttentionFn] = None) -> ModuleSpec:
    """``--transformer-impl transformer_engine``: mcore's Transformer Engine GPT layer spec
    (what Megatron-LM runs on GPUs by default: layernorm fused into the QKV and FC1 GEMMs)
    with :class:`SkrullCoreAttention` as ``core_attention``.  TE's norms carry their own
    sequence-parallel marks; the final norm is mcore's ``TENorm``.  Checkpoints are the
    local spec's (mcore maps the local spec's norm keys onto TE's).

    Raises:
        ValueError: Transformer Engine does not import (the message names the fix).
    """
    from skrull_ext.attention.choice import te_available

    if not te_available():
        raise ValueError("--transformer-impl transformer_engine needs Transformer Engine "
                         "(import transformer_engine.pytorch failed); install it (pip install "
                         "'skrull-megatron[gpu]') or use --transformer-impl local")
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_with_transformer_engine_spec)

    spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=args.qk_layernorm)
    spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
        module=SkrullCoreAttention,
        params={"attention_fn": attention_fn, "rotary_base": args.rotary_base})
    return spec


def block_spec(args: ModelArgs, config: TransformerConfig,
               attention_fn: Optional[AttentionFn] = None, transformer_impl: str = "local"):
    """The decoder: this stage's layers of :func:`layer_spec` and the final norm.

    A bare layer spec would give the final norm mcore's default (``WrappedTorchNorm``
    without apex), so with SP the block's submodules are spelled out: the final norm is
    the layers' norm class.
    """
    if transformer_impl == "transformer_engine":
        return te_layer_spec(args, attention_fn)
    spec = layer_spec(args, attention_fn, config.sequence_parallel)
    if not config.sequence_parallel:
        return spec
    return TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config),
                                      layer_norm=spec.submodules.input_layernorm)


def _stage_build(cpu_pipeline: bool):
    """Context for building a model: on CPU with PP, mcore's tied-embedding setup moves the
    last stage's copy with ``.cuda()`` (:func:`megatron.skrull.cpu_compat.cuda_to_cpu`)."""
    import contextlib

    from megatron.skrull.cpu_compat import cuda_to_cpu

    return cuda_to_cpu("cpu") if cpu_pipeline else contextlib.nullcontext()


def build_model(args: ModelArgs, *, vocab_size: int, tp_size: int = 1, cp_size: int = 1,
                dtype: torch.dtype = torch.float32, device: torch.device = torch.device("cpu"),
                attention_fn: Optional[AttentionFn] = None,
                recompute: Optional[RecomputeArgs] = None, pp_size: int = 1,
                sequence_parallel: bool = False, transformer_impl: str = "local") -> GPTModel:
    """Builds the model on ``device`` (parallel state must be initialised).

    ``forward(input_ids [1, T], position_ids [1, T], attention_mask=None, labels=[1, T],
    packed_seq_params=SkrullPackedSeqParams(...))`` returns the per-token loss ``[1, T]``
    (or logits ``[1, T, vocab/tp]`` without labels), exactly as ``GPTModel``.

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
        recompute: Activation recompute (``--recompute-*``; default none).
        pp_size: Pipeline stages (must match ``parallel_state``): this rank builds its
            stage's layers, the embedding on the first stage, norm + output on the last.
        sequence_parallel: Megatron's sequence parallelism (``tp_size > 1``); inputs
            padded by :func:`megatron.skrull.micro_batch.pad_micro_batch`.
        transformer_impl: ``local`` (mcore's local spec) or ``transformer_engine``
            (:func:`te_layer_spec`).
    """
    cpu = device.type == "cpu"
    config = transformer_config(args, tp_size=tp_size, cp_size=cp_size, dtype=dtype,
                                recompute=recompute, use_cpu_initialization=cpu,
                                pp_size=pp_size, sequence_parallel=sequence_parallel)
    stage = {}
    if pp_size > 1:
        from megatron.core import parallel_state as ps

        # This rank's stage: embedding on the first, output layer and loss on the last.
        stage = {"pre_process": ps.is_pipeline_first_stage(),
                 "post_process": ps.is_pipeline_last_stage()}
    # RoPE lives in SkrullCoreAttention (see the module docstring): "none" here.
    with _stage_build(cpu and pp_size > 1):
        model = GPTModel(
            config=config,
            transformer_layer_spec=block_spec(args, config, attention_fn, transformer_impl),
            vocab_size=vocab_size, max_sequence_length=args.max_position_embeddings,
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type="none", parallel_output=True, **stage)
    # mcore's torch norms ignore params_dtype; cast everything to one dtype.
    return model.to(device=device, dtype=dtype)
