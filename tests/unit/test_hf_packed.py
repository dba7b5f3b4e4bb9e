"""AWQ and GPTQ linears taken apart (export/hf_packed.py): tensors packed the way each
format's documentation describes (checks/hf_quantized.py), read back to their codes and to the values
scale * (code - zero), exactly; the configs the reader does not take are refused by name.
Control: AWQ's words read in GPTQ's order give other codes."""

from __future__ import annotations

import numpy as np
import pytest

from checks.hf_quantized import pack_words
from triton_tlaloc.export.gguf_packed import PackError, dequantize, layout_of
from triton_tlaloc.export.hf_packed import AWQ_ORDER, HfQuant, hf_quant, unpack

OUT, IN, GROUP = 16, 256, 64


def case(seed: int):
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 16, (OUT, IN), dtype=np.uint8)
    z = rng.integers(0, 16, (IN // GROUP, OUT), dtype=np.uint8)
    s = (rng.standard_normal((IN // GROUP, OUT)) * 0.01).astype(np.float16)
    # the values each format means: scale * (code - zero), per input's group
    want = (s.astype(np.float32).T.repeat(GROUP, axis=1)
            * (q.astype(np.float32) - z.T.astype(np.float32).repeat(GROUP, axis=1)))
    return q, z, s, want


def test_awq_gemm_tensors_read_back_their_codes_and_values():
    q, z, s, want = case(0)
    spec = HfQuant("awq", GROUP, 0)
    packed = unpack(spec, pack_words(q.T, AWQ_ORDER), pack_words(z, AWQ_ORDER), s)
    assert packed.qtype == "B4_G64_Z0_O" and layout_of(packed.qtype).offset
    assert np.array_equal(packed.codes, q)
    assert np.array_equal(dequantize(packed), want)
    plain = unpack(spec, pack_words(q.T), pack_words(z), s)  # the control: GPTQ's order of outputs
    assert not np.array_equal(plain.codes, q)


@pytest.mark.parametrize("fmt,stored_offset", [("gptq", 1), ("gptq_v2", 0)])
def test_gptq_tensors_read_back_their_codes_and_values(fmt, stored_offset):
    q, z, s, want = case(1)
    z = np.maximum(z, stored_offset)  # a "gptq" file stores zero - 1
    want = (s.astype(np.float32).T.repeat(GROUP, axis=1)
            * (q.astype(np.float32) - z.T.astype(np.float32).repeat(GROUP, axis=1)))
    spec = hf_quant({"quantization_config": {"quant_method": "gptq", "bits": 4,
                                             "group_size": GROUP, "desc_act": False,
                                             "checkpoint_format": fmt}})
    qweight = pack_words(q).T  # eight inputs a word: [in / 8, out]
    packed = unpack(spec, np.ascontiguousarray(qweight), pack_words(z - stored_offset), s,
                    g_idx=np.arange(IN) // GROUP)
    assert np.array_equal(packed.codes, q)
    assert np.array_equal(dequantize(packed), want)
    with pytest.raises(PackError, match="g_idx is not input // group_size"):
        unpack(spec, np.ascontiguousarray(qweight), pack_words(z), s,
               g_idx=np.arange(IN)[::-1] // GROUP)


@pytest.mark.parametrize("config,error", [
    ({"quant_method": "awq", "bits": 3, "group_size": 128}, "bits 3"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 100}, "group_size 100"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}, "desc_act true"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "'gemv'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
     "'marlin'"),
])
def test_configs_not_read_are_refused_by_name(config, error):
    with pytest.raises(PackError, match=error):
        hf_quant({"quantization_config": config})
    assert hf_quant({"quantization_config": {"quant_method": "fp8"}}) is None
