"""``--log-throughput``: the flag, the log line's TFLOP/s per GPU and its TensorBoard scalar."""
from __future__ import annotations

import numpy as np
import pytest

from megatron.skrull.training import IterationStats, MetricsLogger

from mcore_helpers import tiny_config


def _stats(it: int, seconds: float, flops):
    return IterationStats(iteration=it, loss=1.0, lr=1e-3, grad_norm=0.5, seconds=seconds,
                          predicted_seconds=None, tokens=1000, micro_batches=1,
                          local_share=1.0, flops=flops)


class _Writer:
    def __init__(self):
        self.scalars = {}

    def add_scalar(self, name, value, step):
        self.scalars[(name, step)] = value


def test_flag_parses_into_the_logging_config():
    assert tiny_config().logging.log_throughput is False
    assert tiny_config(["--log-throughput"]).logging.log_throughput is True


def test_log_line_and_tensorboard_report_tflops_per_gpu():
    lines = []
    log = MetricsLogger(log_interval=2, train_iters=2, enabled=True, printer=lines.append,
                        log_throughput=True, world_size=2)
    log.writer = _Writer()
    log.record(_stats(1, 1.0, 4e12))
    log.record(_stats(2, 2.0, 2e12))
    # (4 + 2) TFLOP over 3 s on 2 GPUs: 1.0 TFLOP/s per GPU for the interval.
    # Megatron's place: right after the elapsed time per iteration
    assert "elapsed time per iteration (ms): 1500.0 | throughput per GPU (TFLOP/s/GPU): 1.0 |" \
        " learning rate:" in lines[0], lines[0]
    assert log.writer.scalars[("throughput", 1)] == pytest.approx(2.0)
    assert log.writer.scalars[("throughput", 2)] == pytest.approx(0.5)


def test_no_throughput_field_without_the_flag_or_the_flops():
    lines = []
    off = MetricsLogger(log_interval=1, train_iters=1, enabled=True, printer=lines.append)
    off.record(_stats(1, 1.0, 4e12))
    on = MetricsLogger(log_interval=1, train_iters=1, enabled=True, printer=lines.append,
                       log_throughput=True)
    on.record(_stats(1, 1.0, None))  # a trainer built without a FLOPs function
    assert all("throughput" not in line for line in lines), lines


def test_launchers_flops_function_counts_the_batch_documents():
    """The FLOPs the launcher attaches to an iteration are the documents', not the bucket's."""
    from megatron.skrull.batch_schedule import model_spec
    from skrull_ext.costmodel.flops import model_flops

    cfg = tiny_config(["--log-throughput"])
    spec = model_spec(cfg, vocab_size=128)
    lengths = np.array([90, 6])
    assert model_flops(spec, lengths) < model_flops(spec, [96])
    assert model_flops(spec, lengths) == pytest.approx(
        96 * spec.linear_flops_per_token() + 6 * 64 * 2 * (90 ** 2 + 6 ** 2))
