"""Soak of the HTTP gateway: ``expeditor serve --http`` under normal OpenAI traffic, with
the hostile inputs of benchmarks/soak_attacks.py mixed in, side by side with a run
without them.

Each run starts a fresh ``serve --http`` (the embedded tiny model unless ``--model``)
and for ``--duration`` seconds keeps ``--lanes`` normal requests in flight:
completions and chat completions, streamed or not, greedy or sampled, 8..32 tokens.
Every normal request must answer 200 with its tokens; one without an answer within
``--request-timeout`` is lost. The RSS and open fds of every process of serve
(scheduler, gateway, worker) are sampled every 2 s. With ``--compare`` (the default)
a run without attacks comes first, then one with them, and the table puts the normal
traffic's p99 latencies side by side.

    .venv/bin/python benchmarks/soak_http.py --duration 600 --json out/soak_http.json

Exit status 1 when a normal request was lost or failed in the attacked run, an attack
got an answer it should not (a 5xx, or a 200 for a request that must be refused), or
a process of serve died; else 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import threading
import time
from collections import Counter, deque
from pathlib import Path
from typing import Any

import aiohttp
from soak import drain
from soak_attacks import Attacks
from soak_load import Samples, percentile, rss_mb_and_fds

from gpu_worker.tiny_model import default_model_dir
from scheduler_svc.launch import child_pids, cmdline, free_port, running_serve

SERVE_FLAGS = ("--num-gpu-blocks=512", "--max-num-seqs=32", "--max-num-batched-tokens=512")
SAMPLE_PERIOD_S = 2.0
ROLES = ("scheduler", "gateway", "worker")


def _normal_body(rng: random.Random) -> tuple[str, dict[str, Any]]:
    sampling: dict[str, Any] = {
        "max_tokens": rng.randint(8, 32),
        "temperature": rng.choice([0.0, 0.8]),
        "stream": rng.random() < 0.5,
    }
    if rng.random() < 0.5:
        prompt = [1, *(rng.randrange(3, 250) for _ in range(rng.randint(4, 120)))]
        return "/v1/completions", {"prompt": prompt, **sampling}
    content = " ".join(rng.choice(["the", "cat", "sat", "on", "a", "mat"]) for _ in range(30))
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": content}], **sampling}


class HttpSoak:
    def __init__(self, url: str, serve_pid: int, args: argparse.Namespace, attacked: bool) -> None:
        self.url, self.args, self.attacked = url, args, attacked
        self.stop = asyncio.Event()
        self.outcomes: Counter[str] = Counter()
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self.samples = {role: Samples(warmup_s=args.duration / 5) for role in ROLES}
        self.pids = {
            role: pid
            for pid in child_pids(serve_pid)
            for role in ROLES
            if f" {role} " in cmdline(pid)
        }
        host, port = url.removeprefix("http://").split(":")
        self.attacks = Attacks(host, int(port), self.stop) if attacked else None

    async def run(self) -> None:
        started = time.monotonic()
        extra = self.attacks.tasks() if self.attacks else []
        tasks = [asyncio.ensure_future(t) for t in (*extra, self._sample(started))]
        timeout = aiohttp.ClientTimeout(total=self.args.request_timeout)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            deadline = started + self.args.duration
            await asyncio.gather(
                *(self._lane(session, i, deadline) for i in range(self.args.lanes))
            )
        self.stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _lane(self, session: aiohttp.ClientSession, lane: int, deadline: float) -> None:
        rng = random.Random(self.args.seed * 1000 + lane)
        while time.monotonic() < deadline:
            path, body = _normal_body(rng)
            sent = time.monotonic()
            try:
                async with session.post(self.url + path, json=body) as reply:
                    payload = await reply.read()
                    outcome = "completed" if reply.status == 200 else f"status {reply.status}"
                    if reply.status == 200 and body["stream"]:
                        if not payload.rstrip().endswith(b"data: [DONE]"):
                            outcome = "stream without [DONE]"
                    elif reply.status == 200 and not json.loads(payload)["choices"]:
                        outcome = "no choices"
            except TimeoutError:
                outcome = "lost"
            except aiohttp.ClientError as exc:
                outcome = f"failed {type(exc).__name__}"
            self.outcomes[outcome] += 1
            if outcome == "completed":
                self.latencies.append(time.monotonic() - sent)
            elif len(self.failures) < 20:
                self.failures.append(f"{path}: {outcome}")

    async def _sample(self, started: float) -> None:
        while not self.stop.is_set():
            for role, pid in self.pids.items():
                sample = rss_mb_and_fds(pid)
                if sample is not None:
                    self.samples[role].add(time.monotonic() - started, sample)
            try:
                await asyncio.wait_for(self.stop.wait(), SAMPLE_PERIOD_S)
            except TimeoutError:
                pass

    def report(self) -> dict[str, Any]:
        died = [role for role, pid in self.pids.items() if rss_mb_and_fds(pid) is None]
        return {
            "attacked": self.attacked,
            "normal": {
                "sent": sum(self.outcomes.values()),
                "outcomes": dict(self.outcomes),
                "lost": self.outcomes["lost"],
                "p50_s": percentile(self.latencies, 50),
                "p99_s": percentile(self.latencies, 99),
                "failures": self.failures,
            },
            "attacks": self.attacks.log.report() if self.attacks else None,
            "processes": {role: self.samples[role].report() for role in self.pids},
            "died": died,
        }


def one_run(args: argparse.Namespace, attacked: bool) -> dict[str, Any]:
    port = free_port()
    model = args.model or default_model_dir()
    flags = (*SERVE_FLAGS, "--http", f"127.0.0.1:{port}")
    with running_serve(model, *flags, lines=2) as (lines, proc):
        assert proc.stderr is not None
        tail: deque[str] = deque(maxlen=40)
        threading.Thread(target=drain, args=(proc.stderr, tail), daemon=True).start()
        soak = HttpSoak(lines[1], proc.pid, args, attacked)
        asyncio.run(soak.run())
        report = soak.report()
    report["serve_log_tail"] = list(tail)
    return report


def problems(run: dict[str, Any]) -> list[str]:
    found = [f"{role} died" for role in run["died"]]
    normal = run["normal"]
    bad = normal["sent"] - normal["outcomes"].get("completed", 0)
    if bad:
        found.append(f"{bad} normal requests not completed ({normal['lost']} lost)")
    if run["attacks"] and run["attacks"]["unexpected"]:
        found.append(f"unexpected attack answers: {run['attacks']['unexpected'][:5]}")
    return found


def render(runs: list[dict[str, Any]]) -> str:
    lines = []
    for run in runs:
        n = run["normal"]
        label = "with attacks" if run["attacked"] else "without attacks"
        lines.append(f"== {label}")
        lines.append(f"  normal requests sent {n['sent']}, outcomes {n['outcomes']}")
        lines.append(f"  normal latency p50 {n['p50_s']:.3f} s, p99 {n['p99_s']:.3f} s")
        for role, p in run["processes"].items():
            rss, fds = p["rss_mb"], p["fds"]
            lines.append(
                f"  {role:<9} RSS MB warm-up {rss['warmup']} max {rss['max']} final "
                f"{rss['final']} (growth {rss['growth']}); fds {fds['warmup']} max "
                f"{fds['max']} final {fds['final']}"
            )
        if run["attacks"]:
            for name, answers in run["attacks"]["answers"].items():
                slowest = run["attacks"]["max_answer_s"][name]
                lines.append(f"  attack {name:<20} {answers} (slowest {slowest} s)")
    if len(runs) == 2 and runs[0]["normal"]["p99_s"] and runs[1]["normal"]["p99_s"]:
        ratio = runs[1]["normal"]["p99_s"] / runs[0]["normal"]["p99_s"]
        lines.append(f"p99 of normal traffic, attacked / attack-free: {ratio:.2f}x")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load per run")
    parser.add_argument("--lanes", type=int, default=8, help="normal requests in flight")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout", type=float, default=120.0)
    parser.add_argument("--model", type=Path, help="checkpoint directory (default: tiny model)")
    parser.add_argument("--no-compare", action="store_true", help="only the attacked run")
    parser.add_argument("--json", type=Path, help="write every figure here")
    args = parser.parse_args()
    runs = [] if args.no_compare else [one_run(args, attacked=False)]
    runs.append(one_run(args, attacked=True))
    found = problems(runs[-1])
    print(render(runs))
    print("FAILED: " + "; ".join(found) if found else "PASSED")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"runs": runs, "failures": found}, indent=2) + "\n")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
