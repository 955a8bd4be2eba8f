# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Per-token-head KV scales on packed (cross-layer) KV caches stay in their layer.

Triton's per-token-head dtypes (``int8_per_token_head``, ``fp8_per_token_head``)
keep one float32 scale per (token, head) in padding after each head's data, and
``TritonAttentionImpl._ensure_scale_caches`` carves scale views out of the cache
view's storage. In vLLM 0.25.1 those views start at storage offset 0 and step one
page per block, ignoring where a packed layer's page sits in its block row: with
the #47054 configuration (OffloadingConnector, cross-layer blocks, HND) every
layer gets the same scale bytes and layers of a group overwrite each other's
scales, silently. The unpacked control lives in test_packed_kv_cache_quantized.py.
"""

import pytest

from tests.v1.worker.test_packed_kv_cache_quantized import (
    PER_TOKEN_HEAD_DTYPES,
    check_scales_stay_in_their_layer,
)

pytestmark = pytest.mark.cpu_test


@pytest.mark.parametrize("cache_dtype", PER_TOKEN_HEAD_DTYPES)
def test_per_token_head_scales_stay_in_their_packed_layer(tmp_path, cache_dtype):
    check_scales_stay_in_their_layer(tmp_path, cache_dtype, cross_layers=True)
