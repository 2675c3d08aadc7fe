"""``serve_queue`` under the module name ``rlferry.cli`` imports it by: it lives in
:mod:`rlferry.queue.services`."""

from .services import UNIT_START_TIMEOUT, ControllerService, StorageService, serve_queue

__all__ = ["UNIT_START_TIMEOUT", "ControllerService", "StorageService", "serve_queue"]
