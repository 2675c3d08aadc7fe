"""rlferry's checked file format and its checkpoint directories (rlferry.wire.files)."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from conftest import requires_cuda
from rlferry.errors import RequestError
from rlferry.wire import FileFormatError, RaggedRows, WireError
from rlferry.wire.files import (
    FORMAT_VERSION,
    MAGIC,
    new_directory,
    read_file,
    whole_directory,
    write_file,
)

DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


def _same(a, b):
    # a list of tensors comes back as RaggedRows: a list whose rows view one tensor
    assert type(a) is type(b) or {type(a), type(b)} == {list, RaggedRows}, (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.device.type == "cpu"
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_tensor_of_every_dtype_comes_back_bit_for_bit(tmp_path, dtype):
    t = (torch.randn(3, 5) * 4).to(dtype) if dtype != torch.bool else torch.rand(3, 5) > 0.5
    write_file(tmp_path / "t.rlf", {"t": t, "empty": torch.empty(0, 4, dtype=dtype)})
    _same(read_file(tmp_path / "t.rlf"), {"t": t, "empty": torch.empty(0, 4, dtype=dtype)})


def test_nested_values_come_back_as_written(tmp_path):
    value = {
        "step": 7,
        "lr": 1e-4,
        "name": "run",
        "blob": b"\x00\x01",
        "none": None,
        "flags": [True, False],
        "pair": (1, "a"),
        "arrays": [np.arange(6, dtype=np.int32).reshape(2, 3), np.zeros(0)],
        "deep": {"rows": [torch.arange(3), torch.arange(5)], "ids": ["a", "b", "c"] * 40},
        "scalar": torch.tensor(2.5),
        "strided": torch.arange(12.0).reshape(3, 4).t(),
    }
    size = write_file(tmp_path / "v.rlf", value)
    assert size == (tmp_path / "v.rlf").stat().st_size
    back = read_file(tmp_path / "v.rlf")
    _same(back, {**value, "strided": value["strided"].contiguous()})


def test_a_file_starts_with_the_magic_and_the_format_version(tmp_path):
    write_file(tmp_path / "v.rlf", {"a": 1})
    data = (tmp_path / "v.rlf").read_bytes()
    assert data[:8] == MAGIC and int.from_bytes(data[8:12], "little") == FORMAT_VERSION


def test_the_refusal_is_a_request_error_of_the_wire(tmp_path):
    assert issubclass(FileFormatError, WireError) and issubclass(FileFormatError, RequestError)
    assert issubclass(FileFormatError, ValueError)


def test_one_changed_byte_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "v.rlf"
    write_file(path, {"t": torch.arange(1000)})
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(data)
    with pytest.raises(FileFormatError) as e:
        read_file(path)
    assert str(e.value) == (
        f"{path}: checksum mismatch: the bytes are not those written (the file was changed "
        "or corrupted; use another checkpoint)"
    )


def test_a_truncated_file_is_refused_with_the_sizes(tmp_path):
    path = tmp_path / "v.rlf"
    size = write_file(path, {"t": torch.arange(1000)})
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(FileFormatError) as e:
        read_file(path)
    assert str(e.value) == (
        f"{path}: truncated: expected {size} bytes, got {size - 100} (the write did not "
        "finish, or the file was cut or changed)"
    )


def test_a_file_cut_inside_its_header_is_refused_as_truncated(tmp_path):
    path = tmp_path / "v.rlf"
    write_file(path, {"a": 1})
    path.write_bytes(path.read_bytes()[:12])
    with pytest.raises(FileFormatError, match=r"truncated: expected at least 24 bytes, got 12"):
        read_file(path)


def test_a_newer_format_version_is_refused(tmp_path):
    path = tmp_path / "v.rlf"
    write_file(path, {"a": 1})
    data = bytearray(path.read_bytes())
    data[8:12] = (FORMAT_VERSION + 1).to_bytes(4, "little")
    path.write_bytes(data)
    with pytest.raises(FileFormatError) as e:
        read_file(path)
    assert str(e.value) == (
        f"{path}: format version {FORMAT_VERSION + 1}, this rlferry reads versions up to "
        f"{FORMAT_VERSION} (read it with the newer rlferry that wrote it)"
    )


def test_a_torch_save_archive_is_refused_naming_what_it_looks_like(tmp_path):
    path = tmp_path / "model.pt"
    torch.save({"w": torch.ones(2)}, path)
    with pytest.raises(FileFormatError) as e:
        read_file(path)
    assert e.value.looks_like == "a torch.save archive (a zip file)"
    assert str(e.value) == (
        f"{path}: not an rlferry file: it starts like a torch.save archive (a zip file), "
        "which rlferry does not read (loading it can run code); write it with "
        "rlferry.wire.files.write_file"
    )


def test_a_pickle_is_refused_and_never_unpickled(tmp_path):
    path = tmp_path / "state.pkl"
    path.write_bytes(pickle.dumps({"a": 1}, protocol=4))
    with pytest.raises(FileFormatError, match=r"it starts like a pickle") as e:
        read_file(path)
    assert e.value.looks_like == "a pickle" and str(path) in str(e.value)


def test_another_file_is_refused_with_its_first_bytes(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_bytes(b"hello, world")
    with pytest.raises(FileFormatError) as e:
        read_file(path)
    assert str(e.value) == (
        f"{path}: not an rlferry file: it starts with b'hello, w', expected {MAGIC!r} "
        "(a file written by rlferry.wire.files.write_file)"
    )


def test_a_value_the_wire_does_not_carry_is_refused_and_nothing_is_left(tmp_path):
    with pytest.raises(WireError, match=r"cannot encode `\$.x`"):
        write_file(tmp_path / "v.rlf", {"x": object()})
    assert list(tmp_path.iterdir()) == []


def test_a_new_directory_replaces_the_old_one_only_when_whole(tmp_path):
    path = tmp_path / "ckpt"
    with new_directory(path) as d:
        write_file(d / "a.rlf", 1)
    with pytest.raises(RuntimeError), new_directory(path) as d:
        write_file(d / "a.rlf", 2)
        raise RuntimeError("the writer failed")
    assert read_file(whole_directory(path) / "a.rlf") == 1
    with new_directory(path) as d:
        write_file(d / "a.rlf", 3)
    assert read_file(whole_directory(path) / "a.rlf") == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_writer_that_died_between_its_renames_leaves_the_old_one_readable(tmp_path):
    path = tmp_path / "ckpt"
    with new_directory(path) as d:
        write_file(d / "a.rlf", 1)
    path.rename(tmp_path / "ckpt.old")  # where new_directory is when it dies there
    assert whole_directory(path) == tmp_path / "ckpt.old"
    with new_directory(path) as d:
        write_file(d / "a.rlf", 2)
    assert whole_directory(path) == path and read_file(path / "a.rlf") == 2
    assert not (tmp_path / "ckpt.old").exists()


def test_no_checkpoint_is_a_file_not_found_error_naming_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"Checkpoint directory not found: {tmp_path}/x"):
        whole_directory(tmp_path / "x")


_KILLED_WRITER = textwrap.dedent(
    """
    import os, sys, time, torch
    from rlferry.wire.files import new_directory, write_file
    path = sys.argv[1]

    def stall(fd):  # the moment before the data is durable and renamed: die here
        print("writing", flush=True)
        time.sleep(600)

    with new_directory(path) as d:
        write_file(d / "a.rlf", {"v": 2})
        os.fsync = stall
        write_file(d / "big.rlf", torch.ones(64 << 20, dtype=torch.uint8))
    """
)


@pytest.mark.parametrize("where", ["a file", "a directory"])
def test_a_writer_killed_midway_leaves_the_last_whole_checkpoint_readable(tmp_path, where):
    path = tmp_path / ("ckpt.rlf" if where == "a file" else "ckpt")
    if where == "a file":
        write_file(path, {"v": 1})
        script = _KILLED_WRITER.replace("with new_directory(path) as d:", "if True:")
        script = script.replace('d / "a.rlf"', "path + '.unused'").replace('d / "big.rlf"', "path")
    else:
        with new_directory(path) as d:
            write_file(d / "a.rlf", {"v": 1})
        script = _KILLED_WRITER
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(path)], stdout=subprocess.PIPE, env=env, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "writing\n"
        assert any(p.name.startswith(f"{path.name}.tmp-") for p in tmp_path.iterdir())
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    if where == "a file":
        assert read_file(path) == {"v": 1}
    else:
        assert read_file(whole_directory(path) / "a.rlf") == {"v": 1}
        assert whole_directory(path) == path
        with new_directory(path) as d:  # the next whole write clears what the dead one left
            write_file(d / "a.rlf", {"v": 3})
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


@requires_cuda
def test_a_cuda_tensor_is_written_from_the_host(tmp_path):
    t = torch.arange(1000, dtype=torch.bfloat16, device="cuda")
    write_file(tmp_path / "c.rlf", {"t": t, "rows": [t[:3], t[3:10]]})
    back = read_file(tmp_path / "c.rlf")
    assert back["t"].device.type == "cpu" and torch.equal(back["t"], t.cpu())
    assert [r.tolist() for r in back["rows"]] == [t[:3].tolist(), t[3:10].tolist()]
