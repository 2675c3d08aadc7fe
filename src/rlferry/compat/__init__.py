"""Compatibility layers: other projects' APIs on rlferry (``rlferry.compat.transferqueue``)."""
