"""vLLM CPU with its own n-gram speculation on the shared workloads, for the speculative table.

    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
        /tmp/peers/venvs/vllm/bin/python benchmarks/peer_vllm_ngram.py [--workloads W3,W3,W1]

Runs in the peer venv that `../shared/bench/peers/setup.sh vllm hf` builds (the model folder is its
bf16 conversion of the GGUF). Greedy, EOS ignored, the same drafts settings as pagedkv's run.
"""

import argparse
import os
import sys
import time
from pathlib import Path

SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 2,
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="/tmp/peers/models/smollm2-135m-instruct")
    p.add_argument("--workloads", default="W3,W3,W1")
    p.add_argument(
        "--shared", default=str(Path(__file__).resolve().parents[2] / "shared" / "bench")
    )
    args = p.parse_args()
    sys.path.insert(0, args.shared)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    import workloads as wl
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=args.model,
        tokenizer=args.model,
        dtype="bfloat16",
        max_model_len=2048,
        seed=0,
        speculative_config=SPEC,
    )

    def run(reqs):
        return llm.generate(
            [TokensPrompt(prompt_token_ids=r.prompt) for r in reqs],
            [
                SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)
                for r in reqs
            ],
            use_tqdm=False,
        )

    run([wl.Request(list(range(45000, 45040 + i)), 8) for i in range(4)])  # warm-up
    for key in args.workloads.split(","):
        reqs = wl.get(key).requests
        t = time.perf_counter()
        outs = run(reqs)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        print(f"{key}: {tokens / (time.perf_counter() - t):.1f} output tok/s", flush=True)


if __name__ == "__main__":
    main()
