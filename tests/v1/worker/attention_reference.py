# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Dense attention as GPT-OSS computes it, for checking vLLM's paged kernels.

GPT-OSS's attention layers are causal, every other one has a sliding window, and
every one has attention sinks: one learned logit per query head that joins the
softmax denominator but has no value. The GPU kernel tests compare FlashAttention
and Triton unified attention with this reference; test_attention_reference_cpu.py
checks it against vLLM's Triton kernel on CPU and against causal SDPA.
"""

import torch


def backend_window_size(sliding_window: int | None) -> tuple[int, int]:
    """The ``(left, right)`` window that FlashAttentionImpl and TritonAttentionImpl
    pass to their kernels for a causal decoder layer whose KV cache spec has
    SLIDING_WINDOW (None: full attention). Checked against both on CPU."""
    if sliding_window is None:
        return (-1, -1)
    return (sliding_window - 1, 0)


def flashinfer_window_left(sliding_window: int | None) -> int:
    """The ``window_left`` FlashInferImpl plans its wrappers with for a layer whose
    KV cache spec has SLIDING_WINDOW (-1: none). Checked against it on CPU."""
    return backend_window_size(sliding_window)[0]


def reference_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    seq_lens: list[int],
    scale: float,
    query_lens: list[int] | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention in fp32, sequence by sequence.

    QUERY is [sum(query_lens), query heads, head size], the last query_lens[s]
    tokens of each sequence (all of them by default); KEY and VALUE are
    [sum(seq_lens), KV heads, head size]. Query head h reads KV head
    h // (query heads // KV heads). The query at position i sees the key at
    position j iff j <= i and, with SLIDING_WINDOW, i - j < SLIDING_WINDOW. SINKS
    ([query heads], a logit per head, not scaled) adds exp(sink) to each row's
    softmax denominator. Returns [sum(query_lens), query heads, head size].
    """
    query_lens = list(seq_lens) if query_lens is None else list(query_lens)
    assert len(query_lens) == len(seq_lens)
    assert query.shape[0] == sum(query_lens) and key.shape[0] == sum(seq_lens)
    group = query.shape[1] // key.shape[1]
    device = query.device
    outputs, q_start, k_start = [], 0, 0
    for q_len, seq_len in zip(query_lens, seq_lens):
        q = query[q_start : q_start + q_len].float()
        k = key[k_start : k_start + seq_len].float().repeat_interleave(group, dim=1)
        v = value[k_start : k_start + seq_len].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=device)[:, None]
        k_pos = torch.arange(seq_len, device=device)[None, :]
        visible = k_pos <= q_pos
        if sliding_window is not None:
            visible &= q_pos - k_pos < sliding_window
        scores = scores.masked_fill(~visible, -torch.inf)
        if sinks is not None:
            sink_logits = sinks.float().to(device)[:, None, None].expand(-1, q_len, 1)
            scores = torch.cat([scores, sink_logits], dim=-1)
        probs = scores.softmax(dim=-1)[..., :seq_len]  # the sink's share is dropped
        outputs.append(torch.einsum("hqk,khd->qhd", probs, v))
        q_start += q_len
        k_start += seq_len
    return torch.cat(outputs)
