"""RoPE and its long-context scalings: Megatron's position flags and the frequencies they give.

Four kinds, named as Hugging Face's ``rope_type``:

* ``default``: plain RoPE, ``inv_freq[i] = base ** (-2i / dim)``.
* ``linear`` (``--rotary-seq-len-interpolation-factor F``): position interpolation, every
  frequency divided by ``F``.
* ``llama3`` (``--use-rope-scaling --rope-scaling-factor F``): Llama 3.1's band-wise scaling
  (low frequencies / ``F``, high ones kept, a smooth ramp between).
* ``yarn`` (``--position-embedding-type yarn --rotary-scaling-factor F``, ``--yarn-*``,
  ``--mscale``, ``--mscale-all-dim``): YaRN's ramp between interpolated and extrapolated
  frequencies, plus an *attention factor* multiplying cos and sin, i.e. q and k before any
  attention kernel sees them (the logits scale by its square).

The frequencies follow transformers' ``ROPE_INIT_FUNCTIONS`` operation for operation, in
float32 like transformers and mcore, so they are bit-equal to both (tests/test_rope.py checks
transformers 5's functions and mcore's ``RotaryEmbedding`` / ``YarnRotaryEmbedding``).  They
are computed here rather than by calling transformers because a run not started from a Hugging
Face model must not need it, and mcore's classes build CUDA tables and index them by stream row
(see megatron/skrull/model.py).  One difference from mcore: ``linear`` divides the frequencies
by the factor (transformers) instead of multiplying positions by ``1 / factor`` (mcore's
``seq_len_interpolation_factor``); the same map, rounded as transformers rounds it.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any, Optional

POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "yarn", "mrope", "relative", "none")
# Why the other Megatron position embeddings are refused.
_REFUSED = {
    "learned_absolute": "a learned position table; the supported models rotate q/k instead",
    "mrope": "multimodal RoPE needs per-modality position ids, which text data has not",
    "relative": "T5's relative attention bias, an encoder-decoder feature",
    "none": "without position information every supported model gives other results",
}
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeArgs:
    """RoPE flags (Megatron's names; ``ModelArgs`` extends this class, so they stay flat).

    ``rope_scaling_*`` (llama3's band edges) and ``yarn_attention_factor`` have no Megatron
    flag: they come from a Hugging Face config (Megatron fixes llama3's at 1, 4 and 8192).
    """

    position_embedding_type: str = "rope"
    rotary_percent: float = 1.0
    rotary_seq_len_interpolation_factor: Optional[float] = None
    use_rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    rope_scaling_low_freq_factor: float = 1.0
    rope_scaling_high_freq_factor: float = 4.0
    rope_scaling_original_max_position_embeddings: int = 8192
    rotary_scaling_factor: float = 1.0
    yarn_original_max_position_embeddings: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_correction_range_round_to_int: bool = True
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    yarn_attention_factor: Optional[float] = None

    @property
    def rope_type(self) -> str:
        """Hugging Face's name of the scaling: default, linear, llama3 or yarn."""
        if self.position_embedding_type == "yarn":
            return "yarn"
        if self.use_rope_scaling:
            return "llama3"
        return "linear" if self.rotary_seq_len_interpolation_factor is not None else "default"

    def scaled_context(self, max_position_embeddings: int) -> int:
        """Longest sequence the scaled RoPE is made for (at least ``max_position_embeddings``)."""
        extended = {"linear": lambda: max_position_embeddings
                    * (self.rotary_seq_len_interpolation_factor or 1.0),
                    "llama3": lambda: self.rope_scaling_original_max_position_embeddings
                    * self.rope_scaling_factor,
                    "yarn": lambda: self.yarn_original_max_position_embeddings
                    * self.rotary_scaling_factor}.get(self.rope_type, lambda: 0)()
        return max(max_position_embeddings, int(extended))

    def rope_problems(self, head_dim: int) -> list[str]:
        """One message per invalid RoPE setting (``head_dim``: the attention head size)."""
        p = []
        kind = self.position_embedding_type
        if kind in _REFUSED:
            p.append(f"--position-embedding-type {kind} is not supported: {_REFUSED[kind]}; "
                     "use rope (optionally with a scaling) or yarn")
        elif kind not in POSITION_EMBEDDING_TYPES:
            p.append(f"--position-embedding-type {kind!r}: use rope or yarn")
        rot = int(head_dim * self.rotary_percent)
        if not 0 < self.rotary_percent <= 1 or rot < 2 or rot % 2:
            p.append(f"--rotary-percent {self.rotary_percent}: the rotated part of a "
                     f"{head_dim}-dim head must be an even number > 0 of dims, at most all")
        chosen = [f for f, on in (("--position-embedding-type yarn", kind == "yarn"),
                                  ("--use-rope-scaling", self.use_rope_scaling),
                                  ("--rotary-seq-len-interpolation-factor",
                                   self.rotary_seq_len_interpolation_factor is not None)) if on]
        if len(chosen) > 1:
            p.append(f"{' and '.join(chosen)} are different RoPE scalings: pick one")
        p.extend(self._factor_problems())
        return p

    def _factor_problems(self) -> list[str]:
        p = []
        factors = {"linear": ("--rotary-seq-len-interpolation-factor",
                              self.rotary_seq_len_interpolation_factor),
                   "llama3": ("--rope-scaling-factor", self.rope_scaling_factor),
                   "yarn": ("--rotary-scaling-factor", self.rotary_scaling_factor)}
        flag, factor = factors.get(self.rope_type, (None, 1.0))
        if flag and not factor >= 1.0:  # also rejects nan
            p.append(f"{flag} {factor}: a RoPE scaling factor is >= 1 (the context grows by it)")
        if self.rope_type == "llama3" and not (
                0 < self.rope_scaling_low_freq_factor < self.rope_scaling_high_freq_factor
                and self.rope_scaling_original_max_position_embeddings >= 1):
            p.append("llama3 RoPE scaling needs 0 < low_freq_factor < high_freq_factor and "
                     "original_max_position_embeddings >= 1; fix the model's config.json")
        if self.rope_type == "yarn" and not (self.yarn_original_max_position_embeddings >= 1
                                             and self.yarn_beta_fast > 0
                                             and self.yarn_beta_slow > 0):
            p.append("--yarn-original-max-position-embeddings, --yarn-beta-fast and "
                     "--yarn-beta-slow must be > 0")
        return p


def rope_args(model: Any) -> RopeArgs:
    """The :class:`RopeArgs` part of a ``ModelArgs`` (or any object with those fields)."""
    return RopeArgs(**{f.name: getattr(model, f.name) for f in dataclasses.fields(RopeArgs)})


def rope_kwargs(ns: argparse.Namespace) -> dict[str, Any]:
    """``RopeArgs`` fields set on the command line (``None``: Megatron's default)."""
    return {f.name: getattr(ns, f.name) for f in dataclasses.fields(RopeArgs)
            if getattr(ns, f.name, None) is not None}


def flag_problems(ns: argparse.Namespace) -> list[str]:
    """Position flags that are accepted by name only (Megatron's rules for them)."""
    p = []
    if getattr(ns, "no_rope_freq", None) is not None:
        p.append("--no-rope-freq: skipping RoPE in some layers is not supported (every "
                 "supported model rotates q/k in every layer); drop the flag")
    if not getattr(ns, "add_position_embedding", True) and ns.position_embedding_type != "rope":
        p.append("--no-position-embedding is deprecated (Megatron): use "
                 "--position-embedding-type instead")
    return p


def describe(rope: RopeArgs, max_position_embeddings: int) -> str:
    """One log phrase, e.g. ``yarn RoPE x4 from 32768 positions (attention factor 1.1386)``."""
    kind = rope.rope_type
    factor, original = {
        "linear": (rope.rotary_seq_len_interpolation_factor, max_position_embeddings),
        "llama3": (rope.rope_scaling_factor, rope.rope_scaling_original_max_position_embeddings),
        "yarn": (rope.rotary_scaling_factor, rope.yarn_original_max_position_embeddings),
    }.get(kind, (1.0, max_position_embeddings))
    text = f"{kind} RoPE" + (f" x{factor:g} from {original} positions" if factor != 1.0 else "")
    if rope.rotary_percent != 1.0:
        text += f" on {rope.rotary_percent:g} of each head"
    factor = attention_factor(rope)
    return text + (f" (attention factor {factor:.4f})" if factor != 1.0 else "")


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's ``0.1 * mscale * ln(scale) + 1`` (1 for ``scale <= 1``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_factor(rope: RopeArgs) -> float:
    """Factor on cos and sin (1 except for YaRN): transformers' ``attention_factor``.

    Megatron's rule ``mscale(F, --mscale) / mscale(F, --mscale-all-dim)``; with the defaults
    (1, 0) it is YaRN's ``0.1 ln F + 1``, transformers' value without ``mscale`` fields.
    """
    if rope.rope_type != "yarn":
        return 1.0
    if rope.yarn_attention_factor is not None:
        return float(rope.yarn_attention_factor)
    f = rope.rotary_scaling_factor
    return float(yarn_mscale(f, rope.mscale) / yarn_mscale(f, rope.mscale_all_dim))


def inv_frequencies(rope: RopeArgs, head_dim: int, rotary_base: float) -> "torch.Tensor":
    """``[rot_dim / 2]`` float32 inverse frequencies of ``rope`` (transformers' arithmetic).

    Args:
        rope: The RoPE flags.
        head_dim: Attention head size (``--kv-channels``); ``rot_dim = int(head_dim *
            rotary_percent)`` dims of it rotate.
        rotary_base: ``--rotary-base`` (``rope_theta``).
    """
    import torch

    dim = int(head_dim * rope.rotary_percent)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim
    inv_freq = 1.0 / (rotary_base ** exponents)
    kind = rope.rope_type
    if kind == "linear":
        return inv_freq / rope.rotary_seq_len_interpolation_factor
    if kind == "llama3":
        return _llama3(inv_freq, rope)
    if kind == "yarn":
        return _yarn(rotary_base ** exponents, rope, dim, rotary_base)
    return inv_freq


def _llama3(inv_freq: "torch.Tensor", rope: RopeArgs) -> "torch.Tensor":
    """Llama 3.1: wavelengths above ``original / low`` divided by the factor, below
    ``original / high`` kept, a linear blend in wavelength-space between."""
    import torch

    factor, low, high = (rope.rope_scaling_factor, rope.rope_scaling_low_freq_factor,
                         rope.rope_scaling_high_freq_factor)
    old_context = rope.rope_scaling_original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_context / high) * ~(wavelen > old_context / low)
    return torch.where(medium, smoothed, scaled)


def _yarn(pos_freqs: "torch.Tensor", rope: RopeArgs, dim: int,
          base: float) -> "torch.Tensor":
    """YaRN: extrapolated frequencies (``1 / pos_freqs``) for dims that turn more than
    ``beta_fast`` times over the original context, interpolated ones (``/ factor``) below
    ``beta_slow`` turns, a linear ramp over the dims between."""
    import torch

    original = rope.yarn_original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.yarn_beta_fast), correction_dim(rope.yarn_beta_slow)
    if rope.yarn_correction_range_round_to_int:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = (1 - ramp).to(dtype=torch.float)
    inv_interpolation = 1.0 / (rope.rotary_scaling_factor * pos_freqs)
    return inv_interpolation * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


@dataclasses.dataclass(frozen=True)
class RopeFrequencies:
    """What one attention layer applies: frequencies, cos/sin factor, dim order.

    Attributes:
        inv_freq: ``[rot_dim / 2]`` float32 (:func:`inv_frequencies`).
        attention_factor: Multiplies cos and sin (YaRN; else 1.0).
        interleaved: mcore's ``rotary_interleaved`` layout of the angle table.
    """

    inv_freq: Any
    attention_factor: float = 1.0
    interleaved: bool = False

    @classmethod
    def build(cls, rope: RopeArgs, head_dim: int, rotary_base: float,
              interleaved: bool = False) -> "RopeFrequencies":
        return cls(inv_frequencies(rope, head_dim, rotary_base), attention_factor(rope),
                   interleaved)

    def angles(self, positions: "torch.Tensor") -> "torch.Tensor":
        """``[T, 1, 1, rot_dim]`` float32 angles at ``positions`` (``[T]`` int64), laid out
        like mcore's ``RotaryEmbedding.get_emb`` (row ``i`` = its row ``positions[i]``)."""
        import torch

        inv_freq = self.inv_freq.to(positions.device)
        freqs = torch.outer(positions.to(inv_freq.dtype), inv_freq)
        if self.interleaved:
            emb = torch.stack((freqs, freqs), dim=-1).reshape(freqs.shape[0], -1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb[:, None, None, :]
