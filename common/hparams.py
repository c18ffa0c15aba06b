"""Constants of the original TensorFlow CIFAR-10 multi-GPU tutorial (docs/equivalence.md §1)."""

IMAGE_SIZE = 24  # images are cropped from 32x32 to 24x24
NUM_CLASSES = 10
BATCH_SIZE = 128  # per tower

MOVING_AVERAGE_DECAY = 0.9999  # decay of the moving average of the weights
NUM_EPOCHS_PER_DECAY = 350.0  # epochs after which the learning rate decays
LEARNING_RATE_DECAY_FACTOR = 0.1  # learning rate decay factor
INITIAL_LEARNING_RATE = 0.1  # initial learning rate

TOWER_NAME = 'tower'  # name scope prefix of each tower: tower_0, tower_1, ...

# Local response normalization, the same for norm1 and norm2.
LRN_DEPTH_RADIUS = 4
LRN_BIAS = 1.0
LRN_ALPHA = 0.001 / 9.0
LRN_BETA = 0.75

# Max pooling, the same for pool1 and pool2.
POOL_KSIZE = 3
POOL_STRIDE = 2

# Input pipeline (train): shuffle_batch sizes and threads.
MIN_FRACTION_OF_EXAMPLES_IN_QUEUE = 0.4
NUM_PREPROCESS_THREADS = 16

# Train distortions.
BRIGHTNESS_MAX_DELTA = 63
CONTRAST_LOWER = 0.2
CONTRAST_UPPER = 1.8


def decay_steps(examples_per_epoch, batch_size, num_gpus):
  """Steps between learning-rate decays, as upstream computes them.

  Args:
    examples_per_epoch: int, training examples present on disk.
    batch_size: int, images per tower.
    num_gpus: int, number of towers.

  Returns:
    int, `int(examples_per_epoch / batch_size / num_gpus * NUM_EPOCHS_PER_DECAY)`.
  """
  return int(examples_per_epoch / batch_size / num_gpus * NUM_EPOCHS_PER_DECAY)


def min_queue_examples(examples_per_epoch):
  """`min_after_dequeue` of the training shuffle queue."""
  return int(examples_per_epoch * MIN_FRACTION_OF_EXAMPLES_IN_QUEUE)
