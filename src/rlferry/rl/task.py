"""The demo's task: reverse a short string of letters, with a character tokenizer made in code.

A prompt is ``length`` letters and the separator, ``"abcde>"``; the answer is the letters
reversed, then EOS: ``"edcba<eos>"``. The reward is exact match (1.0 or 0.0). Nothing is
downloaded and nothing here needs ``transformers``.

Token ids (:class:`Tokenizer`): ``0`` is PAD (``"<pad>"``), ``1`` EOS (``"<eos>"``), ``2``
the separator ``">"``, then one id per letter in the order given (``"a"`` is ``3`` for
the default letters). The vocabulary of the default task has 13 ids.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rlferry.errors import RequestError

__all__ = ["Prompt", "ReverseTask", "Tokenizer"]

PAD = "<pad>"
EOS = "<eos>"
SEP = ">"
IGNORE = -100  # a label the cross-entropy of transformers skips


class Tokenizer:
    """Characters to ids and back: PAD ``0``, EOS ``1``, ``">"`` ``2``, then ``letters``.

    ``encode`` reads the letters, ``">"`` and the special tokens written out (``"<eos>"``,
    ``"<pad>"``); ``decode`` writes them the same way, so ``encode(decode(ids)) == ids``.
    """

    def __init__(self, letters: str = "abcdefghij") -> None:
        if not isinstance(letters, str) or not letters:
            raise RequestError(f"Tokenizer.letters: expected a non-empty str, got {letters!r}")
        for c in letters:
            if c in "<>" or c.isspace() or letters.count(c) > 1:
                raise RequestError(
                    f"Tokenizer.letters: expected distinct characters other than '<', '>' "
                    f"and whitespace, got {letters!r} (check {c!r})"
                )
        self.letters = letters
        self.pad_id = 0
        self.eos_id = 1
        self.sep_id = 2
        self._symbols = [PAD, EOS, SEP, *letters]
        self._ids = {s: i for i, s in enumerate(self._symbols)}

    @property
    def vocab_size(self) -> int:
        return len(self._symbols)

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``; raises ValueError naming the first character not in the
        vocabulary and where it is."""
        ids: list[int] = []
        i = 0
        while i < len(text):
            for special in (EOS, PAD):
                if text.startswith(special, i):
                    ids.append(self._ids[special])
                    i += len(special)
                    break
            else:
                c = text[i]
                if c not in self._ids:
                    raise RequestError(
                        f"Tokenizer.encode: expected the letters {self.letters!r}, '>', "
                        f"'<eos>' or '<pad>', got {c!r} at index {i} of {text!r} "
                        "(make the tokenizer with every letter the task uses)"
                    )
                ids.append(self._ids[c])
                i += 1
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` (EOS as ``"<eos>"``, PAD as ``"<pad>"``); raises ValueError
        naming the first id outside the vocabulary."""
        out: list[str] = []
        for i, t in enumerate(ids):
            t = int(t)
            if not 0 <= t < len(self._symbols):
                raise RequestError(
                    f"Tokenizer.decode: expected ids in [0, {len(self._symbols)}), got {t} "
                    f"at index {i} (ids from another tokenizer or model vocabulary?)"
                )
            out.append(self._symbols[t])
        return "".join(out)


@dataclass(frozen=True)
class Prompt:
    """One problem: ``ids`` go to the engine; ``answer`` is the expected response
    without its EOS. ``text`` is ``ids`` decoded (``"abcde>"``)."""

    text: str
    ids: list[int]
    answer: list[int]


class ReverseTask:
    """Reverse ``length`` letters drawn (with replacement) from ``letters``.

    ``"abcde>"`` -> ``"edcba<eos>"``. Sample the engine with ``max_tokens`` (``length +
    1``) and ``stop_token_ids=(tokenizer.eos_id,)`` at temperature 1.

    The reward (:meth:`reward`) is 1.0 when the response, read up to and including its
    first EOS, is exactly the answer followed by EOS; else 0.0. A response that reaches
    ``max_tokens`` without EOS scores 0.0, even if it is the answer: stopping is part of
    the task, and the EOS token is trained like any other. What follows the first EOS is
    not read.
    """

    def __init__(self, length: int = 5, letters: str = "abcdefghij") -> None:
        if type(length) is not int or length < 1:
            raise RequestError(f"ReverseTask.length: expected an int >= 1, got {length!r}")
        self.length = length
        self.tokenizer = Tokenizer(letters)

    @property
    def max_tokens(self) -> int:
        """The response length that fits the answer and its EOS."""
        return self.length + 1

    def sample(self, n: int, rng: random.Random) -> list[Prompt]:
        """``n`` prompts drawn with ``rng`` (the same seed gives the same prompts)."""
        letters = self.tokenizer.letters
        prompts = []
        for _ in range(n):
            word = "".join(rng.choice(letters) for _ in range(self.length))
            text = word + SEP
            prompts.append(
                Prompt(text=text, ids=self.tokenizer.encode(text), answer=self.answer(word))
            )
        return prompts

    def answer(self, prompt: str | Sequence[int]) -> list[int]:
        """The expected response of a prompt (its text or its ids), without the EOS."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if ids and ids[-1] == self.tokenizer.sep_id:
            ids = ids[:-1]
        return ids[::-1]

    def reward(self, prompt: Prompt | Sequence[int], response_ids: Sequence[int]) -> float:
        """1.0 if ``response_ids`` up to its first EOS is the answer of ``prompt`` (a
        :class:`Prompt` or its ids, as the engine got them) then EOS, else 0.0."""
        answer = prompt.answer if isinstance(prompt, Prompt) else self.answer(prompt)
        eos = self.tokenizer.eos_id
        response = [int(t) for t in response_ids]
        if eos not in response:
            return 0.0
        return 1.0 if response[: response.index(eos)] == answer else 0.0

    def sft_batch(self, n: int, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
        """A supervised batch for the warm start: ``input_ids`` are prompt, answer and EOS
        (``(n, 2 * length + 2)``, int64, no padding); ``labels`` are the same ids with
        -100 on the prompt, so the loss counts the answer and its EOS only."""
        rows = [p.ids + p.answer + [self.tokenizer.eos_id] for p in self.sample(n, rng)]
        input_ids = torch.tensor(rows, dtype=torch.long)
        labels = input_ids.clone()
        labels[:, : self.length + 1] = IGNORE
        return input_ids, labels
