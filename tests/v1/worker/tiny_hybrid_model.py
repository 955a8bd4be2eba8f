# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A tiny random-weight GPT-OSS checkpoint, generated locally (no download).

GPT-OSS is the model of vllm#47054: its layers alternate sliding-window and full
attention, so vLLM gives it two KV cache groups, the shape that cross-layer
packing acts on. Weights are random but seeded; the tokenizer is a byte-level
BPE trained here on a few sentences. As a script: python tiny_hybrid_model.py OUT
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "vLLM serves large language models with paged attention.",
    "Key and value caches are offloaded to CPU memory in blocks.",
    "Sliding window layers and full attention layers share one block row.",
    "Hello, world! The answer is 42.",
]
FORMAT = "tiny-gpt-oss-4"  # bump when the config or tokenizer below change


def byte_level_bpe(special_tokens: list[str]) -> Tokenizer:
    """A byte-level BPE (512 tokens, specials first) trained on CORPUS.

    Byte-level: any text encodes and any id decodes, with no unknown token.
    Shared with tiny_chat_model.py: a change here changes both models, so bump
    both FORMATs.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(CORPUS, trainer)
    return bpe


@contextlib.contextmanager
def generated_model(out: Path, model_format: str) -> Iterator[Path | None]:
    """Where to write a generated checkpoint: None when OUT already holds one of
    MODEL_FORMAT, else a folder beside OUT that replaces it once the block ends
    (an interrupted generation leaves OUT as it was)."""
    marker = out / "forkbuild-model.json"
    if marker.exists() and json.loads(marker.read_text()).get("format") == model_format:
        yield None
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    (tmp / marker.name).write_text(json.dumps({"format": model_format}) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


# Grouped-query attention as in GPT-OSS (64 query, 8 KV heads), kept small: under
# Triton's interpreter (the CPU engine test) the attention kernel's cost grows with
# the heads (measured: 8/8 heads 108 s, 4/2 heads 30 s).
NUM_ATTENTION_HEADS = 4
NUM_KV_HEADS = 2


def make_tiny_gpt_oss(
    out: Path,
    num_attention_heads: int = NUM_ATTENTION_HEADS,
    num_kv_heads: int = NUM_KV_HEADS,
) -> Path:
    """The tiny GPT-OSS in OUT (generated unless OUT holds it already). Other head
    counts serve tensor parallelism: a rank must keep at least 2 KV heads, or the
    HND and NHD orders of its pages are the same bytes."""
    model_format = FORMAT
    if (num_attention_heads, num_kv_heads) != (NUM_ATTENTION_HEADS, NUM_KV_HEADS):
        model_format += f"-q{num_attention_heads}-kv{num_kv_heads}"
    with generated_model(out, model_format) as tmp:
        if tmp is not None:
            _write_tiny_gpt_oss(tmp, num_attention_heads, num_kv_heads)
    return out


def _write_tiny_gpt_oss(tmp: Path, num_attention_heads: int, num_kv_heads: int) -> None:
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=byte_level_bpe(["<|endoftext|>"]),
        eos_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    tokenizer.save_pretrained(tmp)

    num_layers = 4
    config = GptOssConfig(
        vocab_size=len(tokenizer),  # every id the model emits decodes to text
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=num_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=128,
        layer_types=[
            "sliding_attention" if i % 2 == 0 else "full_attention"
            for i in range(num_layers)
        ],
        max_position_embeddings=4096,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    model = GptOssForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(tmp, safe_serialization=True)
    # Plain bf16 weights: vLLM reads any quantization_config key (even null) as MXFP4,
    # which the CPU engine does not run.
    config_file = tmp / "config.json"
    saved = json.loads(config_file.read_text())
    saved.pop("quantization_config", None)
    config_file.write_text(json.dumps(saved, indent=2) + "\n")


if __name__ == "__main__":
    print(make_tiny_gpt_oss(Path(sys.argv[1])))
