"""A tiny random-weight GPT-2 with its own byte-level BPE tokenizer,
saved to a directory: a model `transformers serve` can load with no
network (nothing is downloaded; the weights mean nothing, the serving path
is real)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_BUILD = r"""
import sys
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

out = sys.argv[1]
tok = Tokenizer(models.BPE(unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.train_from_iterator(
    ["hello world the quick brown fox jumps over the lazy dog"] * 50,
    trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|endoftext|>"],
                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()),
)
fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                               bos_token="<|endoftext|>", unk_token="<unk>")
fast.chat_template = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
)
torch.manual_seed(0)
cfg = GPT2Config(vocab_size=len(fast), n_positions=64, n_embd=32, n_layer=1, n_head=2,
                 bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id)
GPT2LMHeadModel(cfg).save_pretrained(out)
fast.save_pretrained(out)
"""

# `transformers serve` started as this interpreter, isolated (-I): its
# console script is `transformers.cli.transformers:main`.
SERVE = [sys.executable, "-I", "-c",
         "import sys; from transformers.cli.transformers import main; "
         "sys.argv[0] = 'transformers'; sys.exit(main())", "serve"]  # fmt: skip
READY = r"Uvicorn running on (?P<url>http://[0-9.]+:[0-9]+)"


def build(out: Path) -> Path:
    subprocess.run([sys.executable, "-I", "-c", _BUILD, str(out)], check=True,
                   capture_output=True, timeout=300, env={"HF_HUB_OFFLINE": "1",
                                                          "PATH": "/usr/bin:/bin"})  # fmt: skip
    return out
