"""What a mixture of experts costs against the dense model with the same active parameters:
a qwen3_moe of E experts (top k, each of `inter` channels) on every layer, and a qwen3 whose
MLP has k * inter channels, the same otherwise (random weights, f32). Exported with batch 1 and
a context of 1,024, a prompt of --prompt tokens in one prefill call, then --steps greedy
tokens. A third target is the same mixture with every expert run in decode too (the prompt's
formulation: each expert's weights read, E / k times the work) to show what reading only the
chosen experts buys. The targets take turns, a fresh prompt each round; medians over rounds.

    .venv/bin/python scripts/moe_bench.py [--rounds 3] [--experts 16] [--top-k 2]
        [--weight-quant int4]

--weight-quant exports every target so (int4: the experts packed as the dense MLP's linears
are, and the dense model's linears).

Prints each target's decode ms/token and prefill ms, and their ratios to the dense model's
(docs/performance.md#mixtures-of-experts).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def checkpoints(out: Path, a) -> dict[str, Path]:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=4096, hidden_size=a.hidden, num_hidden_layers=a.layers,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=a.hidden // 8,
                  max_position_embeddings=2048, initializer_range=0.02, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2)
    configs = {
        "moe": Qwen3MoeConfig(**common, intermediate_size=a.top_k * a.inter,
                              moe_intermediate_size=a.inter, num_experts=a.experts,
                              num_experts_per_tok=a.top_k, norm_topk_prob=True,
                              decoder_sparse_step=1, mlp_only_layers=[]),
        "dense": Qwen3Config(**common, intermediate_size=a.top_k * a.inter),
    }
    paths = {}
    for name, cfg in configs.items():
        path = out / f"ckpt-{name}"
        if not path.exists():
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
        paths[name] = path
    return paths


def artifacts(out: Path, ckpts: dict[str, Path], weight_quant) -> dict[str, Path]:
    from triton_tlaloc.export import ExportOptions, export_artifact, layers, moe

    opts = ExportOptions(batch_ladder=(1,), context_ladder=(1024,), prefill_chunk=512,
                         verify_tokens=(), weight_quant=weight_quant)
    arts = {}
    for name, ckpt in (("dense", ckpts["dense"]), ("moe", ckpts["moe"]),
                       ("moe, every expert", ckpts["moe"])):
        path = out / f"art-{name.replace(', ', '-').replace(' ', '-')}"
        if not path.exists():
            if name == "moe, every expert":  # the prompt's formulation in decode calls too
                layers.mixture = lambda *args: moe.mixture(*args[:5], 0, *args[6:])
            try:
                export_artifact(ckpt, path, opts)
            finally:
                layers.mixture = moe.mixture
        arts[name] = path
    return arts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--inter", type=int, default=256, help="each expert's channels")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--weight-quant", default=None, help="e.g. int4, int8 (default f32)")
    ap.add_argument("--out", default=str(ROOT / "artifacts" / "moe-bench"))
    a = ap.parse_args()
    out = Path(a.out) / f"e{a.experts}-k{a.top_k}-i{a.inter}-h{a.hidden}-l{a.layers}"
    out.mkdir(parents=True, exist_ok=True)
    arts = artifacts(out / (a.weight_quant or "f32"), checkpoints(out, a), a.weight_quant)

    from triton_tlaloc.engine.core import Engine
    from triton_tlaloc.runtime.core import Runtime

    engines = {name: Engine(Runtime(path)) for name, path in arts.items()}
    decode, prefill = {n: [] for n in arts}, {n: [] for n in arts}
    for r in range(a.rounds + 1):  # round 0 warms up (compiles)
        prompt = [(i * 7919 + r * 104729) % 4000 + 50 for i in range(a.prompt)]
        for name, engine in engines.items():
            res = engine.generate_greedy(prompt, a.steps)
            if r:
                decode[name].append(res.median_ms_per_token)
                prefill[name].append(res.prefill_ms)
                print(f"round {r}: {name}: decode {res.median_ms_per_token:.2f} ms/token, "
                      f"prefill {res.prefill_ms:.1f} ms", flush=True)
    dense_d, dense_p = statistics.median(decode["dense"]), statistics.median(prefill["dense"])
    print(f"\n{a.experts} experts, top {a.top_k}, {a.inter} channels each; dense "
          f"{a.top_k * a.inter} channels; hidden {a.hidden}, {a.layers} layers; prompt "
          f"{a.prompt}, {a.steps} tokens; weights {a.weight_quant or 'f32'}; medians of "
          f"{a.rounds} rounds\n")
    print("| target | decode ms/token | / dense | prefill ms | / dense |")
    print("|---|---:|---:|---:|---:|")
    for name in arts:
        d, p = statistics.median(decode[name]), statistics.median(prefill[name])
        print(f"| {name} | {d:.2f} | {d / dense_d:.2f}x | {p:.1f} | {p / dense_p:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
