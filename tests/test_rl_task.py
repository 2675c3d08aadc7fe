"""The demo's task (tokenizer, prompts, reward, supervised batches) and its model presets."""

import random

import pytest
import torch

from rlferry.rl.model import make_model, model_config
from rlferry.rl.task import Prompt, ReverseTask, Tokenizer

TASK = ReverseTask()
TOK = TASK.tokenizer
EOS = TOK.eos_id


def ids(text: str) -> list[int]:
    return TOK.encode(text)


# tokenizer


def test_tokenizer_layout_pad_eos_separator_then_letters():
    assert (TOK.pad_id, TOK.eos_id, TOK.sep_id) == (0, 1, 2)
    assert TOK.encode("abj>") == [3, 4, 12, 2]
    assert TOK.vocab_size == 13


def test_tokenizer_round_trip_with_special_tokens():
    text = "hgfed>abc<eos><pad><pad>"
    assert TOK.decode(TOK.encode(text)) == text
    every = list(range(TOK.vocab_size))
    assert TOK.encode(TOK.decode(every)) == every
    assert TOK.decode(every) == "<pad><eos>>abcdefghij"


def test_encode_names_an_unknown_character_and_where():
    with pytest.raises(ValueError) as e:
        TOK.encode("abz>")
    assert str(e.value) == (
        "Tokenizer.encode: expected the letters 'abcdefghij', '>', '<eos>' or '<pad>', "
        "got 'z' at index 2 of 'abz>' (make the tokenizer with every letter the task uses)"
    )


def test_encode_refuses_a_bare_angle_bracket():
    with pytest.raises(ValueError, match="got '<' at index 1 of 'a<eo'"):
        TOK.encode("a<eo")


def test_decode_names_an_id_outside_the_vocabulary():
    with pytest.raises(ValueError) as e:
        TOK.decode([3, 13])
    assert str(e.value) == (
        "Tokenizer.decode: expected ids in [0, 13), got 13 at index 1 "
        "(ids from another tokenizer or model vocabulary?)"
    )


def test_tokenizer_refuses_repeated_or_reserved_letters():
    with pytest.raises(ValueError) as e:
        Tokenizer("aba")
    assert str(e.value) == (
        "Tokenizer.letters: expected distinct characters other than '<', '>' and "
        "whitespace, got 'aba' (check 'a')"
    )
    with pytest.raises(ValueError, match=r"got 'ab>' \(check '>'\)"):
        Tokenizer("ab>")


# prompts


def test_sample_is_letters_then_separator_with_the_reversed_answer():
    prompts = TASK.sample(50, random.Random(0))
    for p in prompts:
        assert len(p.text) == 6 and p.text[-1] == ">"
        assert set(p.text[:-1]) <= set("abcdefghij")
        assert p.ids == TOK.encode(p.text)
        assert TOK.decode(p.answer) == p.text[:-1][::-1]
    assert len({p.text for p in prompts}) == 50


def test_sample_is_deterministic_with_a_seed():
    assert TASK.sample(8, random.Random(7)) == TASK.sample(8, random.Random(7))
    assert TASK.sample(8, random.Random(7)) != TASK.sample(8, random.Random(8))


def test_task_length_and_letters():
    task = ReverseTask(length=3, letters="xy")
    (p,) = task.sample(1, random.Random(0))
    assert len(p.ids) == 4 and task.max_tokens == 4
    assert task.tokenizer.vocab_size == 5
    with pytest.raises(ValueError) as e:
        ReverseTask(length=0)
    assert str(e.value) == "ReverseTask.length: expected an int >= 1, got 0"


# reward

PROMPT = Prompt(text="abcde>", ids=ids("abcde>"), answer=ids("edcba"))


def test_reward_exact_answer_then_eos_is_one():
    assert TASK.reward(PROMPT, ids("edcba<eos>")) == 1.0


def test_reward_wrong_answer_is_zero():
    assert TASK.reward(PROMPT, ids("edcbb<eos>")) == 0.0
    assert TASK.reward(PROMPT, ids("abcde<eos>")) == 0.0


def test_reward_reads_only_up_to_the_first_eos():
    assert TASK.reward(PROMPT, ids("edcba<eos>abc")) == 1.0
    assert TASK.reward(PROMPT, ids("edcba<eos><eos><pad>")) == 1.0
    assert TASK.reward(PROMPT, ids("edc<eos>ba<eos>")) == 0.0  # stopped early


def test_reward_without_eos_is_zero_even_for_the_answer():
    assert TASK.reward(PROMPT, ids("edcba")) == 0.0  # cut at max_tokens = 5
    assert TASK.reward(PROMPT, ids("edcbaa")) == 0.0
    assert TASK.reward(PROMPT, ids("edcba>")) == 0.0
    assert TASK.reward(PROMPT, []) == 0.0


def test_reward_of_prompt_ids_as_the_engine_got_them():
    assert TASK.reward(PROMPT.ids, ids("edcba<eos>")) == 1.0
    assert TASK.reward(torch.tensor(PROMPT.ids), torch.tensor(ids("edcba<eos>"))) == 1.0
    assert TASK.reward(PROMPT.ids, ids("edcbb<eos>")) == 0.0


# supervised batches


def test_sft_batch_is_prompt_answer_eos_with_the_prompt_ignored():
    input_ids, labels = TASK.sft_batch(4, random.Random(3))
    assert input_ids.shape == labels.shape == (4, 12)
    assert input_ids.dtype == labels.dtype == torch.long
    prompts = TASK.sample(4, random.Random(3))
    for row, label, p in zip(input_ids.tolist(), labels.tolist(), prompts, strict=True):
        assert row == p.ids + p.answer + [EOS]
        assert label == [-100] * 6 + p.answer + [EOS]
        assert TASK.reward(p, row[6:]) == 1.0


def test_sft_batch_is_deterministic_with_a_seed():
    a, b = TASK.sft_batch(16, random.Random(1)), TASK.sft_batch(16, random.Random(1))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# model presets


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_tiny_preset_is_a_two_layer_llama_of_half_a_million_parameters():
    model = make_model("tiny", 13, seed=0)
    assert type(model).__name__ == "LlamaForCausalLM"
    c = model.config
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.vocab_size) == (
        2,
        128,
        512,
        13,
    )
    # 2 x (attention 4 x 128^2 + MLP 3 x 128 x 512 + 2 norms) + norm + embed + head
    assert n_params(model) == 2 * (4 * 128**2 + 3 * 128 * 512 + 256) + 128 + 2 * 13 * 128
    assert n_params(model) == 528_256
    assert not model.training and next(model.parameters()).dtype == torch.float32


def test_small_preset_is_a_four_layer_llama_of_four_million_parameters():
    model = make_model("small", 13, seed=0)
    assert (model.config.num_hidden_layers, model.config.hidden_size) == (4, 256)
    assert n_params(model) == 4 * (4 * 256**2 + 3 * 256 * 1024 + 512) + 256 + 2 * 13 * 256


def test_qwen3_preset_has_qwen3_0_6b_shapes_with_the_task_vocabulary():
    c = model_config("qwen3-0.6b", 13)
    assert type(c).__name__ == "Qwen3Config"
    shapes = (
        c.hidden_size,
        c.num_hidden_layers,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.head_dim,
        c.intermediate_size,
        c.tie_word_embeddings,
        c.vocab_size,
    )
    assert shapes == (1024, 28, 16, 8, 128, 3072, True, 13)
    import transformers

    with torch.device("meta"):  # shapes only: no memory, no init
        model = transformers.Qwen3ForCausalLM(c)
    per_layer = 1024 * (2048 + 1024 + 1024) + 2048 * 1024 + 3 * 1024 * 3072 + 2 * 128 + 2 * 1024
    assert n_params(model) == 28 * per_layer + 1024 + 13 * 1024  # tied: one embedding
    assert n_params(model) == 440_480_768


def test_same_seed_same_weights_other_seed_other_weights():
    a, b, c = (make_model("tiny", 13, seed=s) for s in (5, 5, 6))
    pa, pb, pc = (torch.cat([p.flatten() for p in m.parameters()]) for m in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)


def test_make_model_leaves_the_global_rng_alone():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    make_model("tiny", 13, seed=1)
    assert torch.equal(torch.rand(3), expected)


def test_make_model_refuses_an_unknown_preset():
    with pytest.raises(ValueError) as e:
        make_model("huge", 13, seed=0)
    assert str(e.value) == (
        "make_model.preset: expected one of 'tiny', 'small' or 'qwen3-0.6b', got 'huge'"
    )
    with pytest.raises(ValueError) as e:
        make_model("tiny", 0, seed=0)
    assert str(e.value) == "make_model.vocab_size: expected an int >= 1, got 0"
