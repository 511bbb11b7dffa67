"""vLLM CPU's beam search on bench_beam_search.py's workload, for the beam search table.

    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=4 \
        /tmp/peers/venvs/vllm/bin/python benchmarks/peer_vllm_beam_search.py

Four prompts x 4 beams x 64 tokens (EOS ignored), then 4 samples each, two rounds; bfloat16,
prefix caching on (vLLM's beam search runs a request per beam a step and leans on it).
"""

import time

from vllm import LLM, SamplingParams
from vllm.sampling_params import BeamSearchParams

MODEL = "/tmp/peers/models/smollm2-135m-instruct"
PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "A paged KV cache"]
WIDTH, TOKENS = 4, 64


def main() -> None:
    llm = LLM(MODEL, dtype="bfloat16", enable_prefix_caching=True, max_model_len=2048, seed=0)
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4))  # warm up
    tokens = len(PROMPTS) * WIDTH * TOKENS
    beams = BeamSearchParams(beam_width=WIDTH, max_tokens=TOKENS, ignore_eos=True)
    samples = SamplingParams(n=WIDTH, temperature=1.0, seed=0, max_tokens=TOKENS, ignore_eos=True)
    for r in range(2):
        t = time.perf_counter()
        llm.beam_search([{"prompt": p} for p in PROMPTS], beams)
        print(f"| {r + 1} | beam search | {tokens / (time.perf_counter() - t):.1f} |")
        t = time.perf_counter()
        llm.generate(PROMPTS, samples, use_tqdm=False)
        print(f"| {r + 1} | sampling | {tokens / (time.perf_counter() - t):.1f} |")


if __name__ == "__main__":
    main()
