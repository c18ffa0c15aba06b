"""The one set of training settings both trainers read. The CLI fills it."""

import dataclasses

from cifar10_towers.common import hparams
from cifar10_towers.common import optimizer as optimizer_lib

DEFAULT_DATA_DIR = '/tmp/cifar10_data'  # upstream's default
DEFAULT_TRAIN_DIR = '/tmp/cifar10_train'  # upstream's default
DEFAULT_EVAL_DIR = '/tmp/cifar10_eval'  # upstream's default; ours where train_dir is read-only
EVAL_SUBDIR = 'eval'  # eval's default: <train_dir>/eval (docs/deviations.md)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Training settings; a field means the same thing in legacy and modern."""
  data_dir: str = DEFAULT_DATA_DIR  # holds cifar-10-batches-bin/
  train_dir: str = DEFAULT_TRAIN_DIR  # checkpoints and summaries; resumed, never deleted
  num_gpus: int = 1  # number of towers, one per device
  batch_size: int = hparams.BATCH_SIZE  # images per tower per step
  max_steps: int = 1000000  # train until global_step reaches this
  log_every: int = 10  # steps between log lines
  summary_every: int = 100  # steps between TensorBoard summaries
  save_every: int = 1000  # steps between checkpoints (one is also written at the end)
  log_device_placement: bool = False  # print where each op runs
  seed: int | None = None  # graph/global random seed; None = nondeterministic
  jit: bool = False  # compile each tower's loss and gradients with XLA (both trainers)
  strategy: str = 'towers'  # modern only: towers, mirrored or multiworker (tf.distribute)
  worker_hosts: tuple = ()  # multiworker: 'host:port' of every worker; () = read TF_CONFIG
  task_index: int = 0  # multiworker: this worker's index in worker_hosts (0 = chief)
  peer_timeout: int = 60  # multiworker: seconds a step waits for its peers, then fails
  startup_timeout: int = 600  # multiworker: seconds the workers wait for each other to start
  optimizer: optimizer_lib.OptimizerSpec = optimizer_lib.OptimizerSpec()  # default upstream's SGD


CHECKPOINT_BASENAME = 'model.ckpt'  # checkpoints are model.ckpt-<global_step>
STRATEGIES = ('towers', 'mirrored', 'multiworker')  # values of TrainConfig.strategy
