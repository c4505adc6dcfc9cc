"""Random blocks of every GGML quantized type llmq decodes, and what PyPI's gguf package
(`gguf.quants.dequantize`) decodes them to: tests/fixtures/gguf-quants-reference.safetensors,
`<TYPE>.blocks` (uint8, the raw blocks) and `<TYPE>.values` (float32). The f16 scale fields
hold finite values of realistic size; every other byte is random.

Run with the reference venv: .cache/pyref/bin/python tests/reference/gguf_quants_reference.py
"""
import os

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize
from safetensors.numpy import save_file

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BLOCKS = 8

# Byte offsets of each block's f16 fields.
HALVES = {
    Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q8_0: [0],
    Q.Q2_K: [80, 82], Q.Q3_K: [108], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208],
}


def main():
    rng = np.random.default_rng(7)
    out = {}
    for qt, halves in HALVES.items():
        _, size = GGML_QUANT_SIZES[qt]
        blocks = rng.integers(0, 256, size=(BLOCKS, size), dtype=np.uint8)
        for at in halves:
            h = (rng.standard_normal(BLOCKS) * 0.05).astype(np.float16)
            blocks[:, at:at + 2] = h.view(np.uint8).reshape(BLOCKS, 2)
        values = dequantize(blocks.reshape(-1), qt).astype(np.float32).reshape(-1)
        out[f"{qt.name}.blocks"] = blocks.reshape(-1)
        out[f"{qt.name}.values"] = values
    save_file(out, os.path.join(ROOT, "tests", "fixtures", "gguf-quants-reference.safetensors"))


if __name__ == "__main__":
    main()
