"""runtime.training pieces both trainers call, so they behave alike."""

import pytest

from cifar10_towers.common import hparams
from cifar10_towers.runtime import training


def test_checked_decay_steps_is_upstreams_formula():
  assert training.checked_decay_steps(50000, 128, 2) == hparams.decay_steps(50000, 128, 2)
  assert training.checked_decay_steps(50000, 128, 2) == int(50000 / 128 / 2 * 350)


def test_checked_decay_steps_refuses_zero_with_the_numbers():
  # 100 examples / 64 batch / 4 towers * 350 epochs = 136.7; x 1000 batch: 0.
  with pytest.raises(training.TrainingError,
                     match=r'^decay_steps = int\(100 examples / 64000 batch / 4 '
                           r'towers \* 350 epochs\) = 0: too few training '
                           r'examples for this batch size\. Use more data or a '
                           r'smaller --batch_size\.$'):
    training.checked_decay_steps(100, 64000, 4)
