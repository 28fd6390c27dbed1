"""Greedy outputs of ``expeditor serve --tensor-parallel-size 2`` against TP=1 on CUDA.

The worker runs bfloat16 on CUDA, so float32 transformers (tests/support/hf_reference.py) is no
oracle here: TP=2 is compared with a TP=1 serve on the same device and dtype. The
row-parallel partial sums are rounded to bfloat16 before the all-reduce, so the two
may part at a near-tie: a prompt passes when its tokens are identical, or up to the
first difference, where TP=1 rates its own token at most ``NEAR_TIE`` nats above
TP=2's. Needs 2 GPUs (run by benchmarks/gpu_check.sh).

    python benchmarks/tp_greedy.py
"""

import os
import sys
import tempfile
from pathlib import Path

from gpu_worker.tiny_model import make_tiny_model
from ipc.client import Client
from scheduler_svc.launch import running_server

DEVICE = os.environ.get("EXPEDITOR_TEST_DEVICE", "cuda")
NEAR_TIE = 0.25
MAX_TOKENS = 16
PROMPTS = [[1, *range(40 + 7 * i, 40 + 7 * i + n)] for i, n in enumerate((4, 30, 45, 12, 9, 20))]


def serve(model: Path, tp: int) -> list[tuple[list[int], list[dict[int, float]]]]:
    flags = ("--device", DEVICE, "--tensor-parallel-size", str(tp), "--num-gpu-blocks", "256")
    with running_server(model, *flags, timeout_s=300) as (address, _):
        with Client(address, timeout=300) as client:
            done = [
                client.generate(
                    prompt_token_ids=p,
                    max_tokens=MAX_TOKENS,
                    temperature=0.0,
                    ignore_eos=True,
                    logprobs=2,
                )
                for p in PROMPTS
            ]
            ranks = sorted(w.rank for w in client.inspect().workers if w.state == "ready")
    assert ranks == list(range(tp)), f"TP={tp}: ready ranks {ranks}"
    return [(c.token_ids, c.samples[0].logprobs or []) for c in done]


with tempfile.TemporaryDirectory() as tmp:
    model = make_tiny_model(Path(tmp) / "llama", arch="llama")
    one, two = serve(model, 1), serve(model, 2)
failed = 0
for i, ((a, logprobs), (b, _)) in enumerate(zip(one, two, strict=True)):
    k = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if k is None and len(a) == len(b):
        print(f"prompt {i}: TP=2 == TP=1 ({len(a)} tokens)")
        continue
    if k is None:
        print(f"prompt {i}: FAIL: {len(a)} tokens at TP=1, {len(b)} at TP=2")
        failed += 1
        continue
    top = logprobs[k]
    gap = top[a[k]] - top[b[k]] if b[k] in top else float("inf")
    ok = gap <= NEAR_TIE
    failed += not ok
    print(
        f"prompt {i}: same {k} tokens, then TP=1 {a[k]} / TP=2 {b[k]}; TP=1 logprob gap "
        f"{gap:.3f} ({'near-tie' if ok else 'FAIL'})"
    )
print(f"TP=2 vs TP=1 on {DEVICE}: {len(PROMPTS) - failed} of {len(PROMPTS)} prompts pass")
sys.exit(1 if failed else 0)
