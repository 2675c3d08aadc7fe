"""Shared memory and copies: the segments a message's large frames travel in between
processes of one host (``_segments``), how a message's frames are moved into and out of
them (``_bulk``), and the copies that move the bytes (``_copies``: streaming stores where
the optional C extension was built, libc's memmove elsewhere)."""
