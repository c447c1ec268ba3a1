"""The simulator's synthetic retrieval documents: answers recoverable from the text, within the block, never in
the passkey test's wording."""

import re

import pytest

from pose_mlx.eval import passkey
from pose_mlx.sim.retrieval import KINDS, retrieval_documents
from pose_mlx.toy import stdlib_texts, train_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from tokenizers import Tokenizer

    folder = train_tokenizer(stdlib_texts(max_files=40), tmp_path_factory.mktemp("tok"), 512)
    return Tokenizer.from_file(str(folder / "tokenizer.json"))


def _size(tokenizer, text):
    return len(tokenizer.encode(text, add_special_tokens=False).ids)


@pytest.mark.parametrize("length", [128, 400])
def test_each_document_holds_its_task_and_answer_in_the_block(tokenizer, length):
    docs = retrieval_documents(tokenizer, 40, length, seed=3)
    assert len(docs) == 40
    layouts = set()
    for i, doc in enumerate(docs):
        task, tail = doc.split("\n\n", 1)
        assert _size(tokenizer, task) + 1 <= length  # + BOS
        assert _size(tokenizer, task) + 1 >= length // 2  # the filler or pairs use the room
        assert _size(tokenizer, doc) + 1 >= length  # the filler after it fills the block
        kind = KINDS[i % len(KINDS)]
        if kind == "needle":
            name, key = re.search(r"the (\w+(?: \w+)?) is (\d{5})\.", task, re.I).groups()
            assert task.endswith(f" {key}.") and task.count(key) >= 2
            assert re.search(rf"(the {name}\?|the {name}\.|the {name} is|was the {name}\?)", task[-80:])
            layouts.add("\n" in task)
        elif kind == "table":
            word, value = re.search(r"Lookup (\w+): (\d{5})\.$", task).groups()
            assert f"{word} = {value};" in task
        else:
            first, second = task.split(" | again: ")
            assert first == second and first
    assert layouts == {True, False}  # needles on lines of their own and run on


def test_never_the_passkey_test_s_wording(tokenizer):
    text = "\n".join(retrieval_documents(tokenizer, 200, 256, seed=0)).lower()
    assert "pass key" not in text and "passkey" not in text
    for sentence in (passkey.NEEDLE.split("{key}")[0], passkey.QUESTION, "Remember it.", passkey.TASK[:40],
                     "important info", "memorize"):
        assert sentence.lower() not in text


def test_seeded_and_too_short(tokenizer):
    assert retrieval_documents(tokenizer, 12, 128, 5) == retrieval_documents(tokenizer, 12, 128, 5)
    assert retrieval_documents(tokenizer, 12, 128, 5) != retrieval_documents(tokenizer, 12, 128, 6)
    assert retrieval_documents(tokenizer, 12, 16, 0) == []
