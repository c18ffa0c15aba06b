"""Both trainers report every step to `on_step(step, seconds, images)` (bench's pacing)."""

import importlib

import pytest

from cifar10_towers.common import devices
from cifar10_towers.runtime import config as config_lib


@pytest.mark.slow
@pytest.mark.parametrize('impl', ['legacy', 'modern'])
def test_on_step_sees_every_step_with_all_towers_images(impl, synth_data_dir,
                                                         tmp_path):
  trainer = importlib.import_module('cifar10_towers.%s.train' % impl)
  config = config_lib.TrainConfig(
      data_dir=synth_data_dir, train_dir=str(tmp_path / 'train'), num_gpus=2,
      batch_size=8, max_steps=4, save_every=100, log_every=100,
      summary_every=100, seed=1)
  calls = []
  extra = {'num_threads': 2} if impl == 'legacy' else {}
  step = trainer.train(config, devices.plan_devices(2),
                       on_step=lambda *args: calls.append(args), **extra)
  assert step == 4
  assert [c[0] for c in calls] == [1, 2, 3, 4]
  assert [c[2] for c in calls] == [16] * 4  # 8 images x 2 towers
  assert all(seconds > 0 for _, seconds, _ in calls)
