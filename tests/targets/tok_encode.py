"""A Python target for tests/test_unwind.py: HF tokenizers' Rust encode
(a wheel's .so, no frame pointers) called N times from Python.
Usage: python3 tok_encode.py N"""

import sys

from pyctl.tokenizer.builders import build_hf_bpe

tok = build_hf_bpe(300)
for i in range(int(sys.argv[1])):
    tok.encode(f"hello world {i}")
