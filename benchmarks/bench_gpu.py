"""GPU forward speed against Hugging Face, per architecture, bf16 and float32 (ratios from one run).

Glossary
    model    a random HF model of each family at roughly 100M-parameter size (configs below), on cuda:0,
             and ours built from it with `from_hf` (the same weights); HF uses eager attention, and its
             Mamba / Mamba-2 / Zamba2 run their torch path unless mamba-ssm's kernels are installed
             (printed as "HF path")
    ratio    median of our forward times / median of HF's, `--reps` timed runs after two warm-ups,
             alternating between the two, each timed between cuda synchronisations
    rel err  max |ours - HF| / max |HF| over the logits (parity check of the same run)

    python benchmarks/bench_gpu.py [--archs gpt2 llama mamba mamba2 zamba2] [--batch 4] [--seq 512]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def configs() -> dict:
    import transformers as t

    return {
        "gpt2": t.GPT2Config(n_embd=768, n_layer=12, n_head=12, n_positions=1024),
        "llama": t.LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
                               num_attention_heads=16, num_key_value_heads=4),
        "mamba": t.MambaConfig(vocab_size=50280, hidden_size=768, state_size=16, num_hidden_layers=24, expand=2),
        "mamba2": t.Mamba2Config(vocab_size=50288, hidden_size=768, state_size=128, num_hidden_layers=24, expand=2,
                                 head_dim=64, num_heads=24, n_groups=1, chunk_size=256),
        "zamba2": t.Zamba2Config(vocab_size=32000, hidden_size=768, num_hidden_layers=12, mamba_d_state=64,
                                 layers_block_type=["mamba"] * 5 + ["hybrid"] + ["mamba"] * 5 + ["hybrid"],
                                 n_mamba_heads=24, mamba_headdim=64, num_attention_heads=12, intermediate_size=3072,
                                 chunk_size=256, max_position_embeddings=2048),
    }


def timed(model, tokens) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model(tokens)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def hf_path(hf) -> str:
    try:
        from transformers.utils.import_utils import is_mamba_ssm_available

        fast = is_mamba_ssm_available()
    except ImportError:
        fast = False
    kind = hf.config.model_type
    return "eager attention" if kind in ("gpt2", "llama") else ("mamba-ssm kernels" if fast else "torch path")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--archs", nargs="+", default=list(configs()))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu needs CUDA")
    from transformers import AutoModelForCausalLM

    from loaders import from_hf

    torch.set_grad_enabled(False)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, batch {args.batch} x {args.seq} tokens")
    print(f"{'arch':8s} {'dtype':9s} {'ours ms':>9s} {'HF ms':>9s} {'ours/HF':>8s} {'rel err':>9s}  HF path")
    for arch in args.archs:
        cfg = configs()[arch]
        for dtype in (torch.bfloat16, torch.float32):
            torch.manual_seed(0)
            hf = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").to("cuda", dtype).eval()
            ours = from_hf(hf)
            tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device="cuda")
            for _ in range(2):
                ours(tokens), hf(tokens)
            t_ours, t_hf = [], []
            for _ in range(args.reps):
                t_ours.append(timed(ours, tokens))
                t_hf.append(timed(hf, tokens))
            a, b = ours(tokens).float(), hf(tokens).logits.float()
            err = ((a - b).abs().max() / b.abs().max()).item()
            mo, mh = statistics.median(t_ours) * 1e3, statistics.median(t_hf) * 1e3
            print(f"{arch:8s} {str(dtype)[6:]:9s} {mo:9.2f} {mh:9.2f} {mo / mh:8.2f} {err:9.2e}  {hf_path(hf)}",
                  flush=True)
            del hf, ours
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
