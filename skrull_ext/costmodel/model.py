"""Cost and memory models (docs/design.md section 2).

Three layers, each usable alone:

* FLOP counts: the paper's proxy :func:`paper_flops` and a fuller per-model count from a
  :class:`ModelSpec` (separate linear and attention terms, forward + backward).
* :class:`TimeModel`: seconds = ``c_linear * linear_flops + c_attention * attention_flops``
  per sequence, plus a constant per micro-batch; :meth:`TimeModel.calibrate` fits the
  coefficients to measured step times by least squares.
* :class:`CommModel`: piecewise-linear collective time in message bytes (flat below the
  first point), and :class:`MemoryModel`: ``bytes = alpha * tokens + beta`` -> bucket size.

:class:`CostModel` bundles them into what the scheduler consumes: per-sequence compute
seconds and per-sequence ring-communication seconds as float64 arrays.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from typing import Iterable, Optional, Sequence

import numpy as np

from skrull_ext import _backend
from skrull_ext.costmodel.activations import peak_bytes_per_token
from skrull_ext.sharding import shard_tokens_array

# Backward of FlashAttention-style kernels costs about 2.5x the forward (two extra
# matmuls plus the recompute of P); linear layers cost 2x their forward in backward.
ATTENTION_TRAIN_FACTOR = 3.5
LINEAR_TRAIN_FACTOR = 3.0


def paper_flops(lengths, hidden_size: int, kv_hidden_size: int) -> np.ndarray:
    """The paper's per-layer proxy: ``(20 h^2 + 4 h h_kv) S + 4 h S^2``.

    Args:
        lengths: ``[K]`` sequence lengths.
        hidden_size: ``h``.
        kv_hidden_size: ``h_kv`` (KV heads x head dim).

    Returns:
        ``[K]`` float64 FLOPs per layer.
    """
    s = np.asarray(lengths, dtype=np.float64)
    h, hkv = float(hidden_size), float(kv_hidden_size)
    return (20.0 * h * h + 4.0 * h * hkv) * s + 4.0 * h * s * s


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Transformer shape, in Megatron's vocabulary."""

    name: str = "custom"
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    vocab_size: int
    swiglu: bool = True
    tied_embeddings: bool = False

    def __post_init__(self):
        for field in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                      "num_query_groups", "vocab_size"):
            if getattr(self, field) < 1:
                raise ValueError(f"ModelSpec.{field} must be >= 1, got {getattr(self, field)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError("num_attention_heads must be divisible by num_query_groups")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_hidden_size(self) -> int:
        return self.head_dim * self.num_query_groups

    def matmul_params_per_layer(self) -> int:
        """Weights touched by the matmuls of one layer (QKV, output projection, MLP)."""
        h, kv, f = self.hidden_size, self.kv_hidden_size, self.ffn_hidden_size
        mlp = (3 if self.swiglu else 2) * h * f
        return h * (h + 2 * kv) + h * h + mlp

    def param_count(self) -> int:
        """Parameters: layer matmuls, QKV biases and norms, embedding (and untied output layer)."""
        h, kv = self.hidden_size, self.kv_hidden_size
        per_layer = self.matmul_params_per_layer() + (h + 2 * kv) + 2 * h
        embeddings = self.vocab_size * h * (1 if self.tied_embeddings else 2)
        return self.num_layers * per_layer + embeddings + h

    def activation_bytes_per_token(self, num_layers: Optional[int] = None) -> float:
        """Activation bytes per token at the peak (``alpha``), bf16, no recompute, TP 1.

        ``num_layers`` counts only that many layers (default all; a pipeline stage's
        share), the terms outside the layers (final norm, logits) always included.  The
        terms are real tensors (:mod:`skrull_ext.costmodel.activations`): per layer
        ``14 h + 6 h_kv + 10 f`` bytes plus a few per head (norm inputs and outputs, the
        QKV output the value view keeps, query and key after RoPE, attention output,
        mcore's unfused SwiGLU: fc1 output, SiLU output, a copy of the up half, product),
        plus the logits and the cross-entropy's fp32 softmax (6 x vocab).
        :class:`skrull_ext.costmodel.memory.TrainingMemory` has the other settings.
        """
        return peak_bytes_per_token(self, elem=2, num_layers=num_layers)

    def static_memory_bytes(self, optimizer_shards: int = 1, grad_bytes: int = 2,
                            weight_bytes: int = 2) -> float:
        """Weights and optimizer memory per device: weights + grads + sharded Adam.

        Args:
            optimizer_shards: Ranks the fp32 master weights and Adam moments (12 bytes per
                parameter) are sharded over (ZeRO-2 / Megatron distributed optimizer over
                the DP x CP group).
            grad_bytes: Bytes per gradient element, kept whole on every device (2 = bf16;
                Megatron keeps a full gradient buffer even when it shards the optimizer).
            weight_bytes: Bytes per weight element (2 = bf16).
        """
        if optimizer_shards < 1:
            raise ValueError("optimizer_shards must be >= 1")
        return float(self.param_count()) * (weight_bytes + grad_bytes + 12.0 / optimizer_shards)

    def linear_flops(self, lengths) -> np.ndarray:
        """``[K]`` training FLOPs (fwd+bwd) of every matmul outside attention, output layer included."""
        s = np.asarray(lengths, dtype=np.float64)
        return self.linear_flops_per_token() * s

    def linear_flops_per_token(self) -> float:
        """:meth:`linear_flops` of one token."""
        per_token = 2.0 * (self.num_layers * self.matmul_params_per_layer()
                           + self.hidden_size * self.vocab_size)
        return LINEAR_TRAIN_FACTOR * per_token

    def attention_flops(self, lengths) -> np.ndarray:
        """``[K]`` training FLOPs of causal attention: ``2 h S^2`` forward per layer, x3.5."""
        s = np.asarray(lengths, dtype=np.float64)
        return self.attention_flops_coef() * s * s * self.num_layers

    def attention_flops_coef(self) -> float:
        """:meth:`attention_flops`' factor before ``S^2 x layers``."""
        return ATTENTION_TRAIN_FACTOR * 2.0 * self.hidden_size

    @classmethod
    def from_json(cls, path: str) -> "ModelSpec":
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
        try:
            return cls(**obj)
        except TypeError as exc:
            raise ValueError(f"{path}: bad model config ({exc}); expected keys "
                             f"{[f.name for f in dataclasses.fields(cls)]}") from exc


# Qwen2.5 shapes (docs/design.md section 8; vocab from the released configs).
MODEL_PRESETS = {
    "qwen2.5-0.5b": ModelSpec(name="qwen2.5-0.5b", num_layers=24, hidden_size=896,
                              ffn_hidden_size=4864, num_attention_heads=14,
                              num_query_groups=2, vocab_size=151936, tied_embeddings=True),
    "qwen2.5-7b": ModelSpec(name="qwen2.5-7b", num_layers=28, hidden_size=3584,
                            ffn_hidden_size=18944, num_attention_heads=28,
                            num_query_groups=4, vocab_size=152064),
}


def get_model_spec(name_or_path: str) -> ModelSpec:
    """A preset by name (``qwen2.5-0.5b``, ``qwen2.5-7b``) or a JSON config file."""
    if name_or_path in MODEL_PRESETS:
        return MODEL_PRESETS[name_or_path]
    if name_or_path.endswith(".json"):
        return ModelSpec.from_json(name_or_path)
    raise ValueError(f"unknown model {name_or_path!r}: use one of {sorted(MODEL_PRESETS)} "
                     "or a JSON model config file")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TimeModel:
    """Seconds of a sequence = ``c_linear * linear_flops + c_attention * attention_flops``.

    Attention kernels lose efficiency on short blocks: with ``attention_half_tokens``
    ``S_half`` the attention term of a block of ``B`` query tokens is scaled by
    ``1 + S_half / B`` (efficiency ``B / (B + S_half)``), and every kernel call costs
    ``attention_call_overhead`` seconds per layer (fwd + bwd).  Both default to 0.
    ``micro_batch_overhead`` is the fixed cost of running one (non-empty) micro-batch, and
    ``iteration_overhead`` that of one iteration outside its micro-batches (gradient
    reduction, optimizer step); it shifts every plan's prediction alike.
    ``ring_step_overhead`` is the fixed compute cost of one ring step (kernel launches,
    per layer, forward + backward), paid ``N`` times per layer by a micro-batch that
    distributes anything over ``N`` ranks.
    """

    c_linear: float
    c_attention: float
    micro_batch_overhead: float = 0.0
    attention_half_tokens: float = 0.0
    attention_call_overhead: float = 0.0
    iteration_overhead: float = 0.0
    ring_step_overhead: float = 0.0

    def __post_init__(self):
        if min(self.c_linear, self.c_attention, self.micro_batch_overhead,
               self.attention_half_tokens, self.attention_call_overhead,
               self.iteration_overhead, self.ring_step_overhead) < 0:
            raise ValueError("TimeModel coefficients must be >= 0")

    def sequence_time(self, model: ModelSpec, lengths) -> np.ndarray:
        """``[K]`` seconds of compute per sequence held whole on one device (fwd+bwd)."""
        s = np.asarray(lengths, dtype=np.float64)
        attn = model.attention_flops(s) * (1.0 + self.attention_half_tokens / np.maximum(s, 1.0))
        return (self.c_linear * model.linear_flops(s) + self.c_attention * attn
                + self.attention_call_overhead * model.num_layers)

    def shard_time(self, model: ModelSpec, lengths, cp_size: int) -> np.ndarray:
        """``[K]`` seconds each of ``cp_size`` ranks computes on a zigzag-sharded sequence.

        Every rank holds ``shard = pad(S) / N`` tokens (zigzag padding included, as the
        simulator and the attention run them): its linear layers on those tokens, and
        ``1 / N`` of the padded sequence's causal attention (zigzag balances it) at the
        efficiency of a block of one shard, in ``N`` block calls per layer (one per ring
        step, each forward + backward) where a local sequence makes one.
        """
        if cp_size <= 1:
            return self.sequence_time(model, lengths)
        n = float(cp_size)
        shard = shard_tokens_array(np.asarray(lengths, dtype=np.int64), cp_size).astype(np.float64)
        attn = model.attention_flops(shard * n) / n * (1.0 + self.attention_half_tokens / shard)
        return (self.c_linear * model.linear_flops_per_token() * shard + self.c_attention * attn
                + self.attention_call_overhead * model.num_layers * n)

    @classmethod
    def calibrate(cls, model: ModelSpec, lengths: Sequence, measured_times: Sequence[float]
                  ) -> "TimeModel":
        """Least-squares fit of the coefficients to measured step times.

        Args:
            model: Model whose FLOP terms are the regressors.
            lengths: One entry per measurement: an int (one sequence) or a list of ints
                (a micro-batch: the terms of its sequences add up).
            measured_times: Seconds per measurement.

        Returns:
            The fitted model; negative coefficients are clamped to 0 and the rest refit.
        """
        if len(lengths) != len(measured_times) or len(lengths) < 3:
            raise ValueError("calibrate needs >= 3 measurements with one time each")
        rows = []
        for item in lengths:
            seqs = np.atleast_1d(np.asarray(item, dtype=np.float64))
            rows.append([model.linear_flops(seqs).sum(), model.attention_flops(seqs).sum(), 1.0])
        a = np.asarray(rows)
        y = np.asarray(measured_times, dtype=np.float64)
        scale = np.maximum(np.abs(a).max(axis=0), 1e-30)  # condition the columns
        active = [0, 1, 2]
        coef = np.zeros(3)
        while active:
            sol, *_ = np.linalg.lstsq(a[:, active] / scale[active], y, rcond=None)
            sol = sol / scale[active]
            if (sol >= 0).all():
                coef[:] = 0.0
                coef[active] = sol
                break
            active.pop(int(np.argmin(sol)))
        return cls(c_linear=float(coef[0]), c_attention=float(coef[1]),
                   micro_batch_overhead=float(coef[2]))


@dataclasses.dataclass(frozen=True, kw_only=True)
class CommModel:
    """Collective time from message size: piecewise linear through measured points.

    Flat at the first point's time below its size (latency-bound), linear between points,
    extrapolated with the last segment's slope above the last point.
    """

    sizes_bytes: tuple[float, ...]
    seconds: tuple[float, ...]

    def __post_init__(self):
        if len(self.sizes_bytes) != len(self.seconds) or len(self.sizes_bytes) < 2:
            raise ValueError("CommModel needs >= 2 (size, seconds) points")
        if any(b <= a for a, b in zip(self.sizes_bytes, self.sizes_bytes[1:])):
            raise ValueError("CommModel sizes must increase")

    def time(self, nbytes) -> np.ndarray:
        """Seconds to move ``nbytes`` (array-like); 0 bytes cost 0."""
        v = np.asarray(nbytes, dtype=np.float64)
        xs, ys = np.asarray(self.sizes_bytes), np.asarray(self.seconds)
        t = np.interp(v, xs, ys)
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        t = np.where(v > xs[-1], ys[-1] + (v - xs[-1]) * slope, t)
        return np.where(v > 0, t, 0.0)

    def linear_fit(self) -> tuple[float, float]:
        """``(latency_s, seconds_per_byte)`` of ``latency + bytes * per_byte``.

        The slope is the last segment's (asymptotic bandwidth); the latency makes the line
        pass through the first point (the latency-bound regime), floored at 0.
        """
        xs, ys = self.sizes_bytes, self.seconds
        per_byte = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return max(ys[0] - xs[0] * per_byte, 0.0), per_byte


_MB = 1024.0 * 1024.0
# The paper's all_gather on one 8xH100 NVLink node (docs/design.md section 2).
H100_NVLINK_COMM = CommModel(
    sizes_bytes=(2 * _MB, 8 * _MB, 32 * _MB, 128 * _MB, 512 * _MB, 1024 * _MB),
    seconds=(53e-6, 98e-6, 286e-6, 911e-6, 3.4e-3, 6.5e-3),
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryModel:
    """Device memory linear in tokens held: ``bytes = alpha * tokens + beta``."""

    alpha: float
    beta: float = 0.0

    def __post_init__(self):
        if self.alpha <= 0:
            raise ValueError("MemoryModel.alpha (bytes per token) must be > 0")

    def bucket_size(self, device_bytes: float, static_bytes: float, margin_bytes: float = 0.0
                    ) -> int:
        """``C = floor((M_device - M_static - margin - beta) / alpha)``; raises if < 1."""
        c = int((device_bytes - static_bytes - margin_bytes - self.beta) // self.alpha)
        if c < 1:
            raise ValueError(
                f"no room for activations: device {device_bytes / 2**30:.1f} GiB - static "
                f"{static_bytes / 2**30:.1f} GiB - margin {margin_bytes / 2**30:.1f} GiB leaves "
                "< 1 token; use more devices (TP/ZeRO), recompute, or a smaller model")
        return c

    @classmethod
    def fit(cls, tokens: Iterable[float], measured_bytes: Iterable[float]) -> "MemoryModel":
        """Least-squares line through (tokens, peak bytes) measurements of a memory profile."""
        x = np.asarray(list(tokens), dtype=np.float64)
        y = np.asarray(list(measured_bytes), dtype=np.float64)
        if x.size < 2 or np.ptp(x) == 0:
            raise ValueError("MemoryModel.fit needs >= 2 distinct token counts")
        alpha, beta = np.polyfit(x, y, 1)
        return cls(alpha=float(alpha), beta=float(beta))

    @classmethod
    def from_model(cls, model: ModelSpec, beta: float = 0.0) -> "MemoryModel":
        """Estimate from the model shape: ``alpha = model.activation_bytes_per_token()``."""
        return cls(alpha=float(model.activation_bytes_per_token()), beta=beta)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CostModel:
    """What the scheduler needs: per-sequence compute and ring seconds (docs/scheduler.md,
    "One time model"; the planner's simulator composes the same terms).

    Per sample of ``S`` tokens, sharded over ``N`` ranks into ``shard = pad(S) / N``:

    * :meth:`compute_seconds`: run whole on one rank (linear + attention);
    * :meth:`share_seconds`: each rank's attention blocks of it, plus ``(lam + nu) x
      shard``: its linear layers on the shard and the final dK/dV return (both outside the
      ring);
    * :meth:`comm_seconds`: ``(mu_N + lam + nu) x shard``, every second that scales with
      its shard but is no attention (``mu_N``: the ring's ``3 (N - 1)`` transfer steps per
      layer); :func:`skrull_ext.scheduler.objective.rank_time` splits it again;
    * :meth:`comm_latency`: per micro-batch with anything distributed, one latency per
      ring step and for the return, and ``N`` ring-step overheads.

    Attributes:
        model: The transformer shape.
        time: Compute coefficients.
        comm: One ring step's time per message size; the scheduler and the simulator both
            use its :meth:`CommModel.linear_fit` (latency + bytes / bandwidth).
        bytes_per_element: 2 for bf16 activations, 4 for fp32.
        objective: How a micro-batch's time is composed from local compute, ring
            communication and distributed compute: ``ring`` (default, ours: step by step as
            the ring runs, each exchange overlapping one block; better plans in the
            simulator: ``benchmarks/paper_table.py``) or ``paper`` (docs/design.md section 3: the
            local work hides the whole ring's communication); see
            :func:`skrull_ext.scheduler.objective.rank_time`.
    """

    model: ModelSpec
    time: TimeModel
    comm: CommModel = H100_NVLINK_COMM
    bytes_per_element: int = 2
    objective: str = "ring"

    def __post_init__(self):
        if self.objective not in ("paper", "ring"):
            raise ValueError(f"CostModel.objective {self.objective!r}: use 'ring' or 'paper'")

    @property
    def micro_batch_overhead(self) -> float:
        return self.time.micro_batch_overhead

    def compute_seconds(self, lengths) -> np.ndarray:
        """``[K]`` float64 seconds to run each sequence whole on one device (fwd+bwd)."""
        return self.time.sequence_time(self.model, lengths)

    def share_seconds(self, lengths, cp_size: int) -> np.ndarray:
        """``[K]`` float64 seconds each of ``cp_size`` ranks spends on a distributed
        sequence outside the ring's transfers (see the class doc)."""
        return self.schedule_arrays(np.asarray(lengths, dtype=np.int64), cp_size)[2]

    def comm_seconds(self, lengths, cp_size: int) -> np.ndarray:
        """``[K]`` float64 seconds of each sequence sharded over ``cp_size`` that scale with
        its shard but are no attention (see the class doc); 0 without CP.

        The ring sends the KV shards of *all* distributed sequences of a micro-batch as one
        message per step, so a micro-batch pays :meth:`comm_latency` once plus the sum of
        these per-sequence terms.
        """
        return self.schedule_arrays(np.asarray(lengths, dtype=np.int64), cp_size)[1]

    @functools.cached_property
    def ring_terms(self) -> tuple[float, ...]:
        """``(lam, beta, ell, o, a)`` of :class:`skrull_ext.scheduler.objective.Objective`:
        linear seconds per token, ring transfer seconds per shard token and step, latency
        per step, ring-step overhead (all three summed over the layers) and the forward
        share of attention work."""
        latency, per_byte = self.comm.linear_fit()
        layers = float(self.model.num_layers)
        return (self.time.c_linear * self.model.linear_flops_per_token(),
                layers * per_byte * self._kv_bytes_per_token(), layers * latency,
                layers * self.time.ring_step_overhead, 1.0 / ATTENTION_TRAIN_FACTOR)

    def _kv_bytes_per_token(self) -> float:
        return 2.0 * self.model.kv_hidden_size * self.bytes_per_element

    @functools.cached_property
    def cost_scalars(self) -> tuple[float, ...]:
        """The coefficients of :meth:`schedule_arrays` folded as numpy applies them, for
        the C++ ``_C.cost_arrays`` (a plain tuple: the model stays picklable)."""
        model, tm = self.model, self.time
        lam, beta = self.ring_terms[:2]
        return (model.linear_flops_per_token(), model.attention_flops_coef(),
                float(model.num_layers), tm.c_linear, tm.c_attention,
                float(tm.attention_half_tokens), tm.attention_call_overhead * model.num_layers,
                lam + beta)

    def shard_token_seconds(self, cp_size: int) -> float:
        """:meth:`comm_seconds` per shard token over ``cp_size`` ranks: ``mu_N + lam + nu``."""
        lam, beta = self.ring_terms[:2]
        return 3.0 * max(cp_size - 1, 0) * beta + (lam + beta)

    def schedule_arrays(self, lengths, cp_size: int, *, backend: str = "python"
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(compute_seconds, comm_seconds, share_seconds)`` of ``[K]`` int64 lengths at once.

        What ``schedule()`` needs on every call, sharing the FLOP terms and shard sizes.
        ``backend="cpp"`` runs them in the C++ core when it is built (``_C.cost_arrays``,
        bit-identical, no numpy call per term: a third of ``schedule()``'s time around the
        core at K = 256).
        """
        if backend == "cpp" and _backend.CPP is not None:
            return _backend.CPP.cost_arrays(lengths, cp_size, self.cost_scalars,
                                            self.shard_token_seconds(cp_size))
        model, tm = self.model, self.time
        s = lengths.astype(np.float64)
        attention = model.attention_flops(s)
        calls = tm.attention_call_overhead * model.num_layers
        half = tm.attention_half_tokens
        # Without the short-block surcharge (half = 0) its factor is 1.0 exactly, and
        # without call overheads their term adds 0.0 to non-negative seconds: skipped.
        att = attention if not half else attention * (1.0 + half / np.maximum(s, 1.0))
        costs = tm.c_linear * model.linear_flops(s) + tm.c_attention * att
        if calls:
            costs = costs + calls
        if cp_size <= 1:
            return costs, np.zeros(lengths.shape, dtype=np.float64), costs
        n = float(cp_size)
        shard = shard_tokens_array(lengths, cp_size).astype(np.float64)
        att = model.attention_flops(shard * n) / n  # the padded sequence's 1/N
        if half:
            att = att * (1.0 + half / shard)
        outside = self.cost_scalars[7]  # lam + nu: linear layers and the dK/dV return
        shares = outside * shard + tm.c_attention * att
        if calls:
            shares = shares + calls * n
        return costs, self.shard_token_seconds(cp_size) * shard, shares

    def comm_latency(self, cp_size: int) -> float:
        """Fixed ring seconds of a micro-batch that has any distributed sequence: a
        latency per ring step (``N - 1`` forward, ``N - 1`` backward) and for the dK/dV
        return, and ``N`` ring-step overheads (see the class doc); 0 without CP."""
        if cp_size <= 1:
            return 0.0
        ell, o = self.ring_terms[2:4]
        return (2.0 * cp_size - 1.0) * ell + cp_size * o


# Peak dense bf16 throughput of an H100 SXM (NVIDIA H100 datasheet: 989.4 TFLOP/s) at the
# model FLOPs utilisation long-context SFT typically reaches (~45% linear, ~35% attention).
H100_PEAK_FLOPS = 989.4e12


def h100_time_model() -> TimeModel:
    return TimeModel(c_linear=1.0 / (0.45 * H100_PEAK_FLOPS),
                     c_attention=1.0 / (0.35 * H100_PEAK_FLOPS),
                     micro_batch_overhead=2e-3)


def default_cost_model(model: str | ModelSpec = "qwen2.5-0.5b") -> CostModel:
    """The H100 cost model used when the caller gives none."""
    spec = model if isinstance(model, ModelSpec) else get_model_spec(model)
    return CostModel(model=spec, time=h100_time_model())
