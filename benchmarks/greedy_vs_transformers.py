"""Greedy output of pagedkv against transformers' on a model folder, float32: a check that a
random-weight folder (benchmarks/random_model.py) runs as transformers runs it before it is timed.

    python benchmarks/greedy_vs_transformers.py DIR [--tokens 16]
"""

from __future__ import annotations

import argparse
import sys

import torch
import transformers

from pagedkv import LLM, SamplingParams

PROMPTS = [[5, 900, 77, 1234, 42, 8, 600] * 3, list(range(300, 340))]  # token ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=16)
    a = ap.parse_args()
    greedy = SamplingParams(temperature=0, max_tokens=a.tokens, ignore_eos=True)
    vocab = transformers.AutoConfig.from_pretrained(a.model).vocab_size
    prompts = [[t % vocab for t in p] for p in PROMPTS]  # (a test folder's vocabulary is small)
    llm = LLM(a.model, dtype="float32")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    ours = [list(o.outputs[0].token_ids) for o in outs]
    hf = transformers.AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    theirs = []
    for p in prompts:
        with torch.inference_mode():
            ids = hf.generate(
                torch.tensor([p]), max_new_tokens=a.tokens, min_new_tokens=a.tokens, do_sample=False
            )
        theirs.append(ids[0, len(p) :].tolist())
    print(f"pagedkv:      {ours}\ntransformers: {theirs}\nequal: {ours == theirs}")
    sys.exit(0 if ours == theirs else 1)


if __name__ == "__main__":
    main()
