"""GGUF files for tests: a copy of a GGUF file with some tensors in other quantized types,
re-encoded by gguf-py's own quantizers from the file's values (a file whose tensors mix types
as a Q4_K_M file's do, made offline)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np


def retyped_gguf(src: Path, dst: Path, new_type: Callable[[str], str | None]) -> Path:
    """`src` written to `dst` with each tensor for which `new_type(name)` gives a type (one
    gguf-py quantizes: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) re-encoded in it; metadata and the other
    tensors as they are."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(str(dst), arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    tensors = []
    for t in reader.tensors:
        kind = new_type(t.name)
        data, qtype = t.data, t.tensor_type
        if kind is not None:
            qtype = gguf.GGMLQuantizationType[kind]
            values = gguf.quants.dequantize(t.data, t.tensor_type)
            data = gguf.quants.quantize(np.asarray(values, np.float32), qtype)
        tensors.append((t.name, data, qtype))
        writer.add_tensor_info(t.name, data.shape, data.dtype, data.nbytes, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, data, _ in tensors:
        writer.write_tensor_data(data)
    writer.close()
    return dst
