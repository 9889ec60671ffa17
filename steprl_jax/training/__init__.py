"""Train state, optimizer, the shared train step, checkpoints."""
from steprl_jax.training.batch import Batch, make_batch, validate_batch
from steprl_jax.training.checkpoint import Checkpointer
from steprl_jax.training.config import LossConfig, OptimizerConfig, TrainStepConfig
from steprl_jax.training.optimizer import lr_schedule, make_optimizer
from steprl_jax.training.state import TrainState, create_train_state, train_state_shardings
from steprl_jax.training.step import make_logprob_fn, make_loss_and_grad, make_train_step

__all__ = [
    "Batch", "Checkpointer", "LossConfig", "OptimizerConfig", "TrainState", "TrainStepConfig",
    "create_train_state", "lr_schedule", "make_batch", "make_logprob_fn", "make_loss_and_grad",
    "make_optimizer", "make_train_step", "train_state_shardings", "validate_batch",
]
