"""Chat data: conversations in the tokenizer's chat template, the loss on the assistant's tokens only
(labels -100 elsewhere); conversations from jsonl, from a `save_to_disk` folder and from a
`datasets.Dataset` given in Python train the joint stage."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
import torch
from run_helpers import TINY_MODEL, records

from gsm_train.config.schema import ConfigError, load_recipe
from gsm_train.data.chat_data import IGNORE_INDEX, encode_conversation, inputs_and_labels
from gsm_train.data.streaming import first_rows
from gsm_train.data.text import DataError, load_text_dataset, pack_tokens, split_eval_ids, stream_records
from gsm_train.models import model_zoo
from gsm_train.train import train_recipe

REPO = Path(__file__).resolve().parents[1]
JOINT = str(REPO / "recipes" / "joint.yaml")
# a ChatML-like template over the byte tokenizer: each turn `<role>content<eos>`
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Sum 2+2?"},
    {"role": "assistant", "content": "4"},
]
# the joint stage on the tiny Llama, GSM's sparse attention only (short rows)
TINY_JOINT = [
    *TINY_MODEL,
    "init_from=null",
    "data.seq_len=32",
    "gsm.sparse_attention.dense_layers=[0]",
    "gsm.kv_compression.enabled=false",
    "gsm.kv_compression.layer_bits={}",
    "logging.progress_bar=false",
    "optim.warmup_steps=1",
    "train.steps=2",
    "train.batch_size=2",
    "logging.eval_batches=1",
    "data.train.fields=[messages]",
    "data.eval_rows=2",
]


_BYTE_TOKENIZER = model_zoo.byte_tokenizer


def chat_tokenizer():
    """The tiny models' byte tokenizer with TEMPLATE as its chat template."""
    tokenizer = _BYTE_TOKENIZER()
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def _conversations(count: int) -> list[dict]:
    return [
        {
            "messages": [
                {"role": "user", "content": f"What is {i} plus {i}?"},
                {"role": "assistant", "content": f"It is {2 * i}."},
            ],
            "source": "synthetic",
        }
        for i in range(count)
    ]


def test_only_the_assistant_turns_are_labels() -> None:
    tokenizer = chat_tokenizer()
    ids, labels = inputs_and_labels(torch.tensor([encode_conversation(tokenizer, CHAT, "chat")]))
    assert tokenizer.decode(
        ids[0]
    ) == "<system>Be brief.<eos><user>Hi<eos><assistant>Hello!<eos><user>Sum 2+2?<eos>" + ("<assistant>4<eos>")
    assert labels.shape == ids.shape
    kept = labels[0][labels[0] != IGNORE_INDEX]
    assert tokenizer.decode(kept) == "Hello!<eos>4<eos>"  # each reply and its end of turn
    assert torch.equal(kept, ids[0][labels[0] != IGNORE_INDEX])


def test_packed_rows_of_a_jsonl_chat_file_carry_the_assistant_labels(tmp_path: Path) -> None:
    tokenizer = chat_tokenizer()
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in _conversations(6)))
    documents = load_text_dataset(str(path), fields=["messages"])
    assert documents.column_names == ["messages"]
    rows = pack_tokens(documents, tokenizer, 16)
    expected = torch.tensor(
        [token for record in _conversations(6) for token in encode_conversation(tokenizer, record["messages"], "")]
    )
    assert torch.equal(rows.flatten(), expected[: rows.numel()])
    _, labels = inputs_and_labels(rows)
    kept = tokenizer.decode(labels.flatten()[labels.flatten() != IGNORE_INDEX])
    assert kept.startswith("It is 0.<eos>It is 2.<eos>") and "plus" not in kept and "<user>" not in kept


def test_a_conversation_field_with_others_and_a_tokenizer_without_template_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in _conversations(2)))
    with pytest.raises(DataError, match=r"field 'messages' holds conversations .* set fields to \[messages\] alone"):
        load_text_dataset(str(path), fields=["messages", "source"])
    with pytest.raises(DataError, match="the tokenizer has no chat template"):
        pack_tokens(load_text_dataset(str(path), fields=["messages"]), _BYTE_TOKENIZER(), 8)


def _eval_tokens(dataset: datasets.Dataset, seq_len: int, rows_evaluated: int) -> int:
    """The tokens the joint stage's evaluation averages over: the labelled ones (shifted) of the
    first evaluated held-out rows, as TINY_JOINT splits them."""
    rows = pack_tokens(load_text_dataset(dataset, fields=["messages"]), chat_tokenizer(), seq_len)
    _, eval_ids = split_eval_ids(len(rows), 2, seed=0)
    _, labels = inputs_and_labels(rows[eval_ids][:rows_evaluated])
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


@pytest.mark.parametrize("given", ["save_to_disk", "dataset"])
def test_chat_data_trains_the_joint_stage_on_the_assistant_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given: str
) -> None:
    monkeypatch.setattr(model_zoo, "byte_tokenizer", chat_tokenizer)
    dataset = datasets.Dataset.from_list(_conversations(40))
    overrides = [*TINY_JOINT, f"output.dir={tmp_path / 'run'}"]
    if given == "save_to_disk":
        dataset.save_to_disk(tmp_path / "saved")
        result = train_recipe(JOINT, [*overrides, f"data.train.path={tmp_path / 'saved'}"])
    else:
        result = train_recipe(JOINT, overrides, train_dataset=dataset)
    evaluated = [r for r in records(result.run_dir) if r["kind"] == "eval"][-1]
    assert evaluated["eval_tokens"] == _eval_tokens(dataset, 32, 2) < 2 * 31  # masked: fewer than all
    assert len(result.losses) == 2 and all(loss == loss for loss in result.losses)


def test_a_recipe_cannot_name_a_python_dataset() -> None:
    with pytest.raises(ConfigError, match="names a datasets.Dataset given in Python"):
        load_recipe(JOINT, ["data.train.path=datasets.Dataset:abc"])


def test_a_dataset_dict_folder_names_its_splits(tmp_path: Path) -> None:
    datasets.DatasetDict({"train": datasets.Dataset.from_list(_conversations(2))}).save_to_disk(tmp_path / "dd")
    with pytest.raises(DataError, match=r"a DatasetDict saved with save_to_disk, with splits \['train'\]"):
        load_text_dataset(str(tmp_path / "dd"), fields=["messages"])


def test_streamed_conversations_give_the_packed_rows(tmp_path: Path) -> None:
    tokenizer = chat_tokenizer()
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in _conversations(6)))
    packed = pack_tokens(load_text_dataset(str(path), fields=["messages"]), tokenizer, 16)
    streamed = first_rows(stream_records(str(path)), tokenizer, 16, len(packed), fields=["messages"])
    assert torch.equal(streamed, packed) and bool((packed < 0).any())


def test_a_template_that_rewrites_earlier_turns_is_refused() -> None:
    tokenizer = chat_tokenizer()  # this one drops every assistant turn but the last, as reasoning templates do
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}<{{ m['role'] }}>{{ m['content'] }}"
        "{{ eos_token }}{% endif %}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    with pytest.raises(DataError, match="renders assistant turn 2 differently alone than within the conversation"):
        encode_conversation(tokenizer, CHAT, "chat")


def test_smollm2s_own_template_trains_the_replies_and_their_end_of_turn() -> None:
    from transformers import AutoTokenizer

    from gsm_train.models.model_zoo import fetch_smollm2

    gguf = fetch_smollm2()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    ids, labels = inputs_and_labels(torch.tensor([encode_conversation(tokenizer, CHAT[1:], "smollm2")]))
    assert tokenizer.decode(ids[0]).startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert tokenizer.decode(labels[0][labels[0] != IGNORE_INDEX]) == "Hello!<|im_end|>\n4<|im_end|>\n"
