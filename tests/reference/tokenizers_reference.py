"""Reference encodings for the real tokenizers the set-up fetches (deploy/setup/setup.sh tokenizers).

Writes tests/fixtures/tokenizers-reference.json: for each family, the ids of a few texts (no
special tokens added) and, where the tokenizer has a chat template, the rendered chat. Llama 3 and
Qwen3 are encoded by transformers; Mistral's SentencePiece model by the sentencepiece package, the
format's own implementation. Needs transformers and sentencepiece, not torch:
  .cache/pyref/bin/python tests/reference/tokenizers_reference.py
"""
import json
import os

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
FIX = os.path.join(ROOT, "tests", "fixtures")

TEXTS = [
    "Hello, world! The capital of France is Paris.",
    "Numbers 1234567 and 3.14159, code: fn main() { println!(\"hi\"); }",
    "Unicode: café naïve 東京 Ελληνικά 🙂🚀  two  spaces\n\nnew paragraph\ttab",
    "<|im_start|>user\nspecial tokens inside text<|im_end|>",
]
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}]


def family_dir(fam):
    return os.path.join(ROOT, ".cache", "tokenizers", fam)


def hf_entry(fam):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(family_dir(fam))
    entry = {"encodings": [{"text": t, "ids": tok(t, add_special_tokens=False)["input_ids"]} for t in TEXTS]}
    if tok.chat_template:
        entry["chat"] = {"messages": CHAT,
                         "text": tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)}
    return entry


def sentencepiece_entry(fam):
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=os.path.join(family_dir(fam), "tokenizer.model"))
    return {"encodings": [{"text": t, "ids": sp.encode(t)} for t in TEXTS]}


def main():
    out = {"llama3": hf_entry("llama3"), "qwen3": hf_entry("qwen3"), "mistral": sentencepiece_entry("mistral")}
    with open(os.path.join(FIX, "tokenizers-reference.json"), "w") as f:
        json.dump(out, f, indent=1, ensure_ascii=False)


if __name__ == "__main__":
    main()
