"""The TensorBoard tags both trainers write: the one tag set, the contract between them."""

from cifar10_towers.common import hparams
from cifar10_towers.common import model_spec

MEAN_LOSS_TAG = 'total_loss'  # the mean of the towers' total losses
LEARNING_RATE_TAG = 'learning_rate'
NUM_SUMMARY_IMAGES = 3  # tower 0's first images of the step


def loss_terms():
  """A tower's loss terms, as legacy names them in its 'losses' collection:
  ('local3/weight_loss', 'local4/weight_loss', 'cross_entropy')."""
  return tuple(f'{layer.name}/weight_loss' for layer in model_spec.LAYERS
               if layer.wd is not None) + ('cross_entropy',)


def tower_tag(tower, name):
  """'tower_<i>/<name>'."""
  return f'{hparams.TOWER_NAME}_{tower}/{name}'


def activations_tag(prefix, layer):
  """A layer's activations histogram: '<prefix>/<layer>/activations'."""
  return f"{prefix and prefix + '/'}{layer}/activations"


def sparsity_tag(prefix, layer):
  """A layer's fraction of zero activations: '<prefix>/<layer>/sparsity'."""
  return f"{prefix and prefix + '/'}{layer}/sparsity"


def gradients_tag(variable_name):
  """The averaged gradient of a variable: 'conv1/weights/gradients'."""
  return f'{variable_name}/gradients'


def image_tags():
  """What the input images are written as: 'images/image/0', ... (TF1's naming)."""
  return [f'images/image/{i}' for i in range(NUM_SUMMARY_IMAGES)]


def summary_tags(num_towers, activations=True):
  """{'scalars', 'histograms', 'images'} -> sorted tags both trainers write.

  `activations`: with the per-layer activation, sparsity and gradient
  summaries and the images (False: the subset the replica engines write).
  """
  names, layers = model_spec.VARIABLE_NAMES, [layer.name for layer in model_spec.LAYERS]
  scalars = [MEAN_LOSS_TAG, LEARNING_RATE_TAG]
  histograms = [*names, *map(model_spec.average_name, names)]
  for i in range(num_towers):
    scalars.append(tower_tag(i, 'total_loss'))
    if activations:
      prefix = f'{hparams.TOWER_NAME}_{i}'
      scalars += [tower_tag(i, term) for term in loss_terms()]
      scalars += [sparsity_tag(prefix, layer) for layer in layers]
      histograms += [activations_tag(prefix, layer) for layer in layers]
  if activations:
    histograms += map(gradients_tag, names)
  return {'scalars': sorted(scalars), 'histograms': sorted(histograms),
          'images': image_tags() if activations else []}
