"""The service's tokenizer: a byte-level BPE trained in-process.

It is trained with HF `tokenizers` on the pseudo-language corpus that
pyctl/tokenizer/builders.py generates (deterministic, shipped as code, no
download), so every request's `encode` goes through the Rust
`TokenizerImpl::encode_char_offsets`: the `tok:hf-encode` probe site that
`gpufault inject --lib tokenizers --fn tok:hf-encode` attaches to.
"""

from __future__ import annotations

from typing import Any

from pyctl.tokenizer.builders import HF_SPECIALS, reference_bpe


class ServiceTokenizer:
    """encode/decode plus the special ids the model must not sample."""

    def __init__(self, vocab_size: int = 1000, seed: int = 1) -> None:
        self.tok: Any = reference_bpe(vocab_size, seed)
        self.vocab_size: int = self.tok.get_vocab_size()
        self.pad_id: int = self.tok.token_to_id("[PAD]")
        self.bos_id: int = self.tok.token_to_id("[BOS]")
        self.special_ids: list[int] = [self.tok.token_to_id(s) for s in HF_SPECIALS]

    def encode(self, text: str) -> list[int]:
        # Tokenizer.encode (not encode_batch): one hf-encode call per request.
        ids: list[int] = self.tok.encode(text).ids
        # An empty prompt still needs one position to condition on.
        return ids or [self.bos_id]

    def decode(self, ids: list[int]) -> str:
        text: str = self.tok.decode(ids, skip_special_tokens=True)
        return text
