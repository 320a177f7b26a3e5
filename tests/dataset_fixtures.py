"""Test data made by the tests themselves: a tiny word-level tokenizer (the ``tokenizers``
library, saved as a Hugging Face tokenizer directory with a chat template), JSONL prompts of
additions, and a reward function that checks the sum. Nothing is downloaded."""

from __future__ import annotations

import json
import random
from pathlib import Path

SPECIAL = ["<pad>", "<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>"]
WORDS = ["What", "is", "?", "+", "=", "add", "and", "the", "sum", "of", "answer", ":",
         *[str(n) for n in range(20)]]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def make_tokenizer(directory: Path) -> Path:
    """A word-level tokenizer of 38 tokens (specials, digits, a few words) with a chat
    template, saved to ``directory``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL + WORDS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>",
                                        eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
                                        additional_special_tokens=["<|user|>",
                                                                   "<|assistant|>"])
    tokenizer.chat_template = CHAT_TEMPLATE
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(directory))
    return directory


def addition_rows(count: int, seed: int = 0, *, chat: bool = False) -> list[dict]:
    """Prompts "What is a + b ?" of different lengths, with the answer."""
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        terms = [rng.randint(0, 9) for _ in range(rng.randint(2, 3))]
        text = "What is " + " + ".join(str(t) for t in terms) + " ?"
        prompt: object = [{"role": "user", "content": text}] if chat else text
        rows.append({"id": i, "prompt": prompt, "answer": str(sum(terms))})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


REWARD_FUNCTION = """
def compute_score(prompt, response, row):
    words = response.split()
    return {"score": 1.0 if words and words[-1] == row["answer"] else 0.0}
"""
