"""rlferry: the data plane of asynchronous RL post-training."""

__version__ = "0.1.0"
