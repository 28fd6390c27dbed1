"""Engine settings that drive a short run of the tiny models through each way a schedule
can differ from the default one: chunked prefill, prefix hits, preemption by swap and by
recompute (the pools are small enough that the tests' prompts preempt)."""

from __future__ import annotations

SCENARIOS: dict[str, dict[str, object]] = {
    "chunked": {"block_size": 8, "num_gpu_blocks": 128, "max_num_batched_tokens": 16},
    "prefix": {"block_size": 4, "num_gpu_blocks": 128, "max_num_batched_tokens": 512},
    "swap": {
        "block_size": 4,
        "num_gpu_blocks": 24,
        "num_cpu_blocks": 128,
        "max_num_batched_tokens": 64,
        "preemption_mode": "swap",
        "watermark": 0.0,
    },
    "recompute": {
        "block_size": 4,
        "num_gpu_blocks": 24,
        "max_num_batched_tokens": 64,
        "preemption_mode": "recompute",
        "watermark": 0.0,
    },
}
