# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Importing this module skips the importing test module where vLLM no longer has the
per-backend KV cache layout API these tests drive.

Up to vLLM 0.26 each attention backend declares its cache shape and stride order
(``get_kv_cache_shape``, ``get_kv_cache_stride_order``, a global HND/NHD layout) and
``_reshape_attention_kv_cache`` views packed pages with them. The layout rewrite
(RFC #42082) replaced all of it with ``KVCacheLayout`` and per-layer ``[B, H, N, C]``
views; test_packed_kv_cache_layer_views.py checks the same invariant there.
"""

import pytest

from vllm.v1.worker.gpu import attn_utils

REASON = (
    "this vLLM has no per-backend KV cache layout API (_reshape_attention_kv_cache, "
    "get_kv_cache_shape/stride order; removed by the layout rewrite, RFC #42082); "
    "test_packed_kv_cache_layer_views.py covers the new API"
)

if not hasattr(attn_utils, "_reshape_attention_kv_cache"):
    pytest.skip(REASON, allow_module_level=True)


# FlashInfer (Blackwell's default attention backend) in the same modules as
# FlashAttention: its Python package imports without a GPU. Where it is not
# installed, its cases skip with this reason.
try:
    from vllm.v1.attention.backends.flashinfer import FlashInferBackend

    FLASHINFER_MISSING = ""
except ImportError as exc:
    FlashInferBackend = None
    FLASHINFER_MISSING = f"FlashInfer's Python package does not import here ({exc})"


def flashinfer_param(*values, id: str):
    """A FlashInfer case, skipped with the reason where FlashInfer is missing."""
    return pytest.param(
        *values,
        id=id,
        marks=pytest.mark.skipif(bool(FLASHINFER_MISSING), reason=FLASHINFER_MISSING),
    )
