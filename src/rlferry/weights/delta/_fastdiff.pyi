def diff(
    jobs: list[tuple[int, int, int, int, int, int, int]], threads: int, plain: bool = False
) -> list[int]: ...
def apply(
    tensor: int,
    numel: int,
    itemsize: int,
    counts: int,
    offsets: int,
    values: int,
    changed: int,
    threads: int,
) -> bool: ...
