# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A tiny random-weight Gemma 2 chat checkpoint, generated locally (no download).

The tiny GPT-OSS of tiny_hybrid_model.py answers /v1/completions but not
/v1/chat/completions: vLLM renders and parses GPT-OSS chats with harmony, which
needs special tokens the tiny tokenizer lacks and downloads its own vocabulary,
so offline the chat endpoint fails. This model answers both, offline: its
tokenizer carries a plain ChatML template and the special tokens it uses.

Gemma 2 is chosen for its KV cache plan: its layers alternate sliding-window and
full attention (config.layer_types), so vLLM gives it two KV cache groups, the
same plan as GPT-OSS, and it runs on the CPU engine. Weights are random but
seeded; the tokenizer is the byte-level BPE of tiny_hybrid_model.py plus the
chat tokens. As a script: python tiny_chat_model.py OUT
"""

from __future__ import annotations

import sys
from pathlib import Path

try:
    from tests.v1.worker.tiny_hybrid_model import byte_level_bpe, generated_model
except ImportError:  # run as a script: this file's folder is on sys.path
    from tiny_hybrid_model import byte_level_bpe, generated_model

FORMAT = "tiny-chat-gemma2-1"  # bump when the config or tokenizer below change

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# ChatML; needs nothing but the messages (no tools, no network, no strftime).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{{ message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
NUM_LAYERS = 4
SLIDING_WINDOW = 128
# Even layers slide, odd layers attend to everything: two KV cache groups.
LAYER_TYPES = [
    "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(NUM_LAYERS)
]


def make_tiny_chat_model(out: Path) -> Path:
    with generated_model(out, FORMAT) as tmp:
        if tmp is not None:
            _write_tiny_chat_model(tmp)
    return out


def _write_tiny_chat_model(tmp: Path) -> None:
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=byte_level_bpe([ENDOFTEXT, IM_START, IM_END]),
        eos_token=IM_END,  # a chat turn ends the answer
        bos_token=ENDOFTEXT,
        pad_token=ENDOFTEXT,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    # The template in tokenizer_config.json rather than a chat_template.jinja file.
    tokenizer.save_pretrained(tmp, save_jinja_files=False)

    eos_ids = tokenizer.convert_tokens_to_ids([IM_END, ENDOFTEXT])
    head_dim = 64
    config = Gemma2Config(
        vocab_size=len(tokenizer),  # every id the model emits decodes to text
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=head_dim,
        query_pre_attn_scalar=head_dim,
        sliding_window=SLIDING_WINDOW,
        layer_types=LAYER_TYPES,
        max_position_embeddings=4096,
        eos_token_id=eos_ids,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(tmp, safe_serialization=True)


if __name__ == "__main__":
    print(make_tiny_chat_model(Path(sys.argv[1])))
