"""Where the logging rank's scalars go: TensorBoard and Weights & Biases.

Megatron-LM's ``--wandb-project``/``--wandb-exp-name``/``--wandb-save-dir``/``--wandb-entity``
open one wandb run (``wandb.init(dir=, name=, project=, entity=, config=<the run's flags>)``)
and log the same scalars as TensorBoard, at the iteration as wandb's step.  Without
``WANDB_MODE`` in the environment the run is offline unless ``WANDB_API_KEY`` is set: a
training job never waits on a login prompt or the network, and ``wandb sync DIR`` uploads
an offline run later.  :class:`Writers` fans ``add_scalar`` out to every writer, so the
metrics logger and the evaluator write to TensorBoard and wandb alike.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Any, Optional

from megatron.skrull.errors import ConfigError


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoggingArgs:
    """``--log-interval``, TensorBoard and Megatron-LM's timers / validation PPL / wandb."""

    log_interval: int = 100
    tensorboard_dir: Optional[str] = None
    log_throughput: bool = False  # --log-throughput: TFLOP/s per GPU in the log line
    log_timers_to_tensorboard: bool = False
    log_validation_ppl_to_tensorboard: bool = False
    wandb_project: Optional[str] = None
    wandb_exp_name: Optional[str] = None
    wandb_save_dir: Optional[str] = None
    wandb_entity: Optional[str] = None

    def __post_init__(self) -> None:
        if self.log_interval < 1:
            raise ConfigError([f"--log-interval must be >= 1, got {self.log_interval}"])


def wandb_problems(project: Optional[str], exp_name: Optional[str], save_dir: Optional[str],
                   save: Optional[str]) -> list[str]:
    """Flag problems of ``--wandb-*`` (checked on every rank before anything starts)."""
    if not project:
        return []
    p = []
    if not exp_name:
        p.append("--wandb-project needs --wandb-exp-name NAME (the run's name), as in "
                 "Megatron-LM")
    if not (save_dir or save):
        p.append("--wandb-project needs --wandb-save-dir DIR (or --save DIR, whose wandb/ "
                 "subdirectory it uses)")
    if importlib.util.find_spec("wandb") is None:
        p.append("--wandb-project needs the wandb package: pip install wandb (or drop "
                 "--wandb-project)")
    return p


class WandbWriter:
    """TensorBoard's ``add_scalar(name, value, step)`` on a wandb run (Megatron-LM's
    ``wandb_writer.log({name: value}, iteration)``)."""

    def __init__(self, wandb: Any, run: Any):
        self.wandb, self.run = wandb, run

    def add_scalar(self, name: str, value: float, step: int) -> None:
        self.wandb.log({name: value}, step=step)

    def close(self) -> None:
        self.wandb.finish()


def open_wandb(logging_args: Any, save: Optional[str], config: dict) -> WandbWriter:
    """Starts the wandb run of ``--wandb-project`` (logging rank only).

    Args:
        logging_args: :class:`LoggingArgs`.
        save: ``--save`` (default directory: ``SAVE/wandb``).
        config: The run's flags (``dataclasses.asdict(RunConfig)``), wandb's ``config``.
    """
    import wandb

    save_dir = logging_args.wandb_save_dir or os.path.join(save, "wandb")
    os.makedirs(save_dir, exist_ok=True)
    mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY")
                                            else "offline")
    kwargs = dict(dir=save_dir, name=logging_args.wandb_exp_name,
                  project=logging_args.wandb_project, config=config, mode=mode)
    if logging_args.wandb_entity:
        kwargs["entity"] = logging_args.wandb_entity
    return WandbWriter(wandb, wandb.init(**kwargs))


class Writers:
    """Several scalar writers behind one ``add_scalar``/``close`` (``None`` entries skipped)."""

    def __init__(self, *writers: Any):
        self.writers = [w for w in writers if w is not None]

    def add_scalar(self, name: str, value: float, step: int) -> None:
        for w in self.writers:
            w.add_scalar(name, value, step)

    def close(self) -> None:
        for w in self.writers:
            w.close()
