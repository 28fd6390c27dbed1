"""Soak test of the served path: ``expeditor serve`` under mixed load, faults and bad input.

Starts ``expeditor serve`` (the embedded tiny model unless ``--model DIR``) with a small KV
pool and a swap pool, so requests are preempted and swapped, and for ``--duration``
seconds keeps ``--concurrency`` requests in flight from ``--clients`` AsyncClients:
generate and stream requests with random token-id prompts (ids 3..250, 1..200 tokens;
now and then a text prompt), max_tokens 1..64, some with n=2, stop strings or
ignore_eos. Meanwhile:

- some streams are broken off after a few deltas and some requests are aborted by id;
- now and then a client with requests in flight is closed abruptly and replaced;
- bursts of bad frames on a raw DEALER (random bytes, truncated msgpack, a map nested
  1,000 deep, a 1 MB string field, wrongly typed fields, a two-part message): each must
  get an ErrorReply within 5 s;
- once, at a third of the duration, one worker process is SIGKILLed (serve restarts it);
- once, half way, a 10 MB text prompt, which must be refused as ``bad_request`` (its time
  to answer and the ping round trips and other requests' latencies meanwhile are kept);
- once, a prompt with a token id outside the vocabulary, which must be refused as
  ``bad_request``.

Every request gets exactly one outcome: completed, aborted (by this script), refused
(an ErrorReply, by code), disconnected (its client was closed by this script) or failed;
one with no outcome 30 s after the load stopped is lost. After the load the scheduler
must hold no request, no sequence and no KV block (GPU and swap pool). The scheduler's
RSS and open fds are sampled every 2 s (at warm-up end, max, final).

    .venv/bin/python benchmarks/soak.py --duration 600 --json out/soak.json

prints a table and writes every figure to ``--json`` (``tests/e2e/test_soak.py`` runs it with
``--duration 25 --concurrency 8``). Exit status 1 if a request was lost, a request or KV
block leaked, a request ended in an unexpected error, a bad frame went unanswered, the
worker was not back in time, the server died, or the run overran its time bound; else 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
from collections import Counter, deque
from pathlib import Path
from typing import IO, Any

from soak_load import EXAMPLES, Outcome, percentile
from soak_run import SERVE_FLAGS, Soak

from gpu_worker.tiny_model import default_model_dir
from scheduler_svc.launch import running_server


def drain(stream: IO[bytes], tail: deque[str]) -> None:
    """Read a pipe of serve to its end (so it never blocks on a full pipe), keeping a tail."""
    for line in iter(stream.readline, b""):
        tail.append(line.decode(errors="replace").rstrip())


def summarize(soak: Soak) -> dict[str, Any]:
    """Every figure of a finished run, for the table and ``--json``."""
    records = soak.ledger.records
    outcomes = Counter(r.outcome for r in records)
    latencies = [r.ended_at - r.sent_at for r in records if r.outcome is Outcome.COMPLETED]
    by_kind: dict[str, Counter[str]] = {}
    for r in records:
        by_kind.setdefault(r.kind, Counter())[str(r.outcome or "lost")] += 1
    lost = [r for r in records if r.outcome is None]
    return {
        "config": {
            "duration_s": soak.args.duration,
            "concurrency": soak.args.concurrency,
            "clients": soak.args.clients,
            "seed": soak.args.seed,
            "request_timeout_s": soak.args.request_timeout,
            "serve_flags": list(SERVE_FLAGS),
        },
        "requests": {
            "sent": len(records),
            "completed": outcomes[Outcome.COMPLETED],
            "aborted": outcomes[Outcome.ABORTED],
            "refused": dict(Counter(r.code for r in records if r.outcome is Outcome.REFUSED)),
            "disconnected": outcomes[Outcome.DISCONNECTED],
            "failed": outcomes[Outcome.FAILED],
            "lost": len(lost),
            "lost_examples": [f"{r.kind} {r.request_id}" for r in lost[:EXAMPLES]],
            "worker_lost": soak.worker_lost,
            "unexpected": soak.ledger.unexpected.total(),
            "unexpected_by_kind": dict(soak.ledger.unexpected),
            "unexpected_examples": soak.ledger.examples,
            "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
        },
        "latency_s": {
            "completed": len(latencies),
            "p50": percentile(latencies, 50),
            "p99": percentile(latencies, 99),
            "max": max(latencies, default=None),
        },
        "abort_calls": dict(soak.abort_calls),
        "disconnects": {
            "clients_closed": len(soak.disconnects),
            "requests": sum(soak.disconnects),
        },
        "bad_frames": {
            "sent": sum(c["sent"] for c in soak.frames.values()),
            "answered": sum(c["answered"] for c in soak.frames.values()),
            "by_kind": {k: dict(v) for k, v in sorted(soak.frames.items())},
            "unanswered_examples": soak.unanswered,
        },
        "scheduler": {
            "pid": soak.scheduler_pid,
            "died": soak.died or None,
            "died_at_s": soak.report.get("server_died_at_s"),
            **soak.samples.report(),
        },
        "worker_kill": soak.report.get("worker_kill"),
        "big_prompt": soak.report.get("big_prompt"),
        "out_of_vocab": soak.report.get("out_of_vocab"),
        "final_state": soak.report.get("final_state"),
        "load_s": soak.report.get("load_s"),
        "overran": soak.report.get("overran", False),
    }


def failures(report: dict[str, Any]) -> list[str]:
    """Why the soak failed; empty when it passed."""
    found = []
    if report.get("serve_error"):
        return [f"serve did not start: {report['serve_error']}"]
    requests, frames = report["requests"], report["bad_frames"]
    if report["scheduler"]["died"]:
        found.append(f"server died: {report['scheduler']['died']}")
    if report["overran"]:
        found.append("the run overran its time bound")
    if requests["lost"]:
        found.append(f"{requests['lost']} requests lost")
    if requests["unexpected"]:
        found.append(f"{requests['unexpected']} unexpected errors")
    if frames["answered"] < frames["sent"]:
        found.append(f"{frames['sent'] - frames['answered']} bad frames unanswered")
    final = report["final_state"]
    if final is None or not final["snapshot"]:
        if not report["scheduler"]["died"]:
            found.append("no final scheduler snapshot")
    else:
        for key in ("leaked_gpu_blocks", "leaked_cpu_blocks", "requests_held", "seqs"):
            if final[key]:
                found.append(f"{key}: {final[key]}")
    kill = report["worker_kill"]
    if kill is not None and not kill["recovered"]:
        found.append("the killed worker was not replaced in time")
    return found


def fmt(*values: Any) -> str:
    """Values for the table, ' / '-separated; floats to 3 decimals, None as '-'."""
    return " / ".join(
        f"{v:.3f}" if isinstance(v, float) else "-" if v is None else str(v) for v in values
    )


def render(report: dict[str, Any]) -> str:
    """A readable table of the figures."""
    rows: list[tuple[str, str]] = []
    if "requests" in report:
        r, lat, frames = report["requests"], report["latency_s"], report["bad_frames"]
        sched, disconnects = report["scheduler"], report["disconnects"]
        final = report["final_state"] or {}
        kill, big = report["worker_kill"] or {}, report["big_prompt"] or {}
        oov = report["out_of_vocab"] or {}
        rows += [
            ("requests sent", fmt(r["sent"])),
            ("  completed", fmt(r["completed"])),
            ("  aborted (by the script)", fmt(r["aborted"])),
            ("  refused, by code", fmt(r["refused"] or None)),
            ("  disconnected (client closed)", fmt(r["disconnected"])),
            ("  failed", fmt(r["failed"])),
            ("  LOST", fmt(r["lost"])),
            ("  worker_lost", fmt(r["worker_lost"])),
            ("unexpected errors", fmt(r["unexpected"], r["unexpected_by_kind"] or None)),
            ("latency s p50 / p99 / max", fmt(lat["p50"], lat["p99"], lat["max"])),
            ("clients closed / requests on them", fmt(*disconnects.values())),
            ("abort calls", fmt(report["abort_calls"] or None)),
            ("bad frames answered / sent", fmt(frames["answered"], frames["sent"])),
            ("server died / at s", fmt(sched["died"] or "no", sched["died_at_s"])),
        ]
        for name in ("rss_mb", "fds"):
            s = sched[name]
            rows.append((f"scheduler {name} warm-up / max / final / growth", fmt(*s.values())))
        timeline = " ".join(f"{t:g}s:{rss:g}MB/{fds}" for t, rss, fds in sched["timeline"])
        rows.append(("scheduler over time (RSS / fds)", timeline or "-"))
        for key in ("requests_held", "seqs", "leaked_gpu_blocks", "leaked_cpu_blocks"):
            rows.append((f"final {key}", fmt(final.get(key))))
        rows += [
            ("preemptions", fmt(final.get("preemptions"))),
            ("worker killed at s / back after s", fmt(kill.get("at_s"), kill.get("recovery_s"))),
            (
                "10 MB prompt: outcome / s / max ping s",
                fmt(big.get("outcome"), big.get("seconds"), big.get("max_ping_s")),
            ),
            ("out-of-vocab prompt: outcome / s", fmt(oov.get("outcome"), oov.get("seconds"))),
        ]
    lines = [f"{label:<48} {value}" for label, value in rows]
    requests = report.get("requests", {})
    examples = [
        *requests.get("unexpected_examples", []),
        *(f"lost: {r}" for r in requests.get("lost_examples", [])),
        *report.get("bad_frames", {}).get("unanswered_examples", []),
    ]
    lines += [f"  ! {example}" for example in examples]
    lines.append("FAILED: " + "; ".join(report["failures"]) if report["failures"] else "PASSED")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight")
    parser.add_argument("--clients", type=int, default=4, help="AsyncClients sharing the load")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout", type=float, default=60.0, help="seconds per request")
    parser.add_argument("--model", type=Path, help="checkpoint directory (default: tiny model)")
    parser.add_argument("--json", type=Path, help="write every figure here")
    args = parser.parse_args()
    if args.duration <= 0 or args.concurrency < 1 or args.clients < 1:
        parser.error("--duration, --concurrency and --clients must be positive")
    tail: deque[str] = deque(maxlen=60)
    report: dict[str, Any]
    try:
        with running_server(args.model or default_model_dir(), *SERVE_FLAGS) as (address, proc):
            assert proc.stderr is not None
            threading.Thread(target=drain, args=(proc.stderr, tail), daemon=True).start()
            soak = Soak(address, proc, args)
            asyncio.run(soak.run())
            report = summarize(soak)
    except RuntimeError as error:
        report = {"serve_error": str(error)[-2000:]}
    report["failures"] = failures(report)
    report["ok"] = not report["failures"]
    report["server_log_tail"] = list(tail)
    print(render(report))
    if report["failures"] and tail:
        print("\nlast lines of serve's log:\n" + "\n".join(list(tail)[-20:]))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
