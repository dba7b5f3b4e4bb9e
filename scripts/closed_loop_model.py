#!/usr/bin/env python3
"""A model of the many-users benchmark's closed loop, to choose how many prompts a mixed step
carries before building it: USERS clients each send a PROMPT-token prompt, stream OUT tokens,
and send the next prompt at once (as aiperf does); the server runs steps of every decoding
stream's next token plus the chunks of up to `--prompts` waiting prompts (a prompt under way
first, then by arrival), or, with no stream decoding, the waiting prompts in prefill calls of
up to 4. A step's time is the decode rows' measured time plus each carried chunk's (padded to
a mixed entry of one, two or four chunks of 192 tokens), from the quiet call times
scripts/mixed_step_bench.py printed (SmolLM2 f32 on this 2-core machine), times `--load` for
the client and front end beside it. It prints what aiperf reports: output tokens/s,
inter-token latency p50/p99 (each request's (last - first token) / (tokens - 1)) and time to
first token p50.

    python3 scripts/closed_loop_model.py [--users 4,16,32] [--prompts 1,2,4] [--load 1.2]

A model, not a measurement: it leaves out the front end's and the client's own times and
every variance (docs/design.md#mixed-steps says what it was used for).
"""

from __future__ import annotations

import argparse

# A decode step's time by rows (ms), and a prompt's chunk per padded token (a 192-token
# prompt call took 730 ms, a 1-row step 30).
DECODE_MS = {0: 0.0, 1: 30.0, 2: 45.0, 4: 60.0, 8: 105.0, 16: 160.0}
CHUNK_TOKENS = 192
TOKEN_MS = 700.0 / CHUNK_TOKENS
PREFILL_BATCH = 4


def decode_ms(rows: int) -> float:
    """Rows past 16 (the largest decode batch) in calls of 16."""
    if rows > 16:
        return decode_ms(16) * (rows // 16) + decode_ms(rows % 16)
    below = max(r for r in DECODE_MS if r <= rows)
    above = min((r for r in DECODE_MS if r >= rows), default=below)
    if above == below:
        return DECODE_MS[below]
    return DECODE_MS[below] + (DECODE_MS[above] - DECODE_MS[below]) * (rows - below) / (
        above - below)


def run(users: int, prompts: int, prompt: int, out: int, load: float, requests: int):
    """(arrival, first token, last token) of each finished request, in ms."""
    now, due = 0.0, {u: 5.0 * u for u in range(users)}  # paced arrivals, 5 ms apart
    arrived, left, streams, done = {}, {}, {}, []
    while len(done) < requests:
        for u in [u for u, t in due.items() if t <= now]:
            arrived[u], left[u] = due.pop(u), prompt
        if not streams and not left:
            now = min(due.values())
            continue
        order = sorted(left, key=lambda u: (left[u] == prompt, arrived[u]))
        carried = order[:prompts if streams else PREFILL_BATCH]
        padded = min(p for p in (1, 2, 4, prompts, PREFILL_BATCH) if p >= len(carried))
        now += (decode_ms(len(streams)) + TOKEN_MS * CHUNK_TOKENS * padded * bool(carried)) * load
        for u in list(streams):
            first, n = streams[u]
            if n + 1 == out:
                done.append((arrived[u], first, now))
                del streams[u]
                due[u] = now + 5.0
            else:
                streams[u] = (first, n + 1)
        for u in carried:
            left[u] -= min(left[u], CHUNK_TOKENS)
            if not left[u]:
                del left[u]
                streams[u] = (now, 1)
    return done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--users", default="4,16,32")
    ap.add_argument("--prompts", default="1,2,4", help="the most prompts a mixed step carries")
    ap.add_argument("--prompt-tokens", type=int, default=158)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--load", type=float, default=1.2)
    args = ap.parse_args()
    print("| users | prompts a step | tokens/s | ITL p50 / p99 ms | TTFT p50 ms |")
    print("|---:|---:|---:|---|---:|")
    for users in map(int, args.users.split(",")):
        for prompts in map(int, args.prompts.split(",")):
            done = run(users, prompts, args.prompt_tokens, args.output_tokens, args.load,
                       requests=40 * users)[2 * users:]  # the first rounds left out
            itl = sorted((last - first) / (args.output_tokens - 1) for _, first, last in done)
            ttft = sorted(first - a for a, first, _ in done)
            span = max(d[2] for d in done) - min(d[1] for d in done)
            rate = len(done) * args.output_tokens / (span / 1e3)
            q = lambda xs, p: xs[min(len(xs) - 1, int(p * len(xs)))]  # noqa: E731
            print(f"| {users} | {prompts} | {rate:.1f} | {q(itl, .5):.0f} / {q(itl, .99):.0f} "
                  f"| {q(ttft, .5):.0f} |")


if __name__ == "__main__":
    main()
