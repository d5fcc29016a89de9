"""The load generator of `tars bench inference`'s front figure, run as its own process (as actors are).

    python -m tars.bench.front_client ADDRESS

Reads one JSON job per line on stdin, {"prompts": [[ids...], ...], "max_new_tokens": N}, sends every prompt at
once (unary Generate, temperature 1, no trajectory id), waits for all of them and writes one JSON line back:
{"tokens": total output tokens, "seconds": wall time of the round}. Ends at EOF. Imports only the client, so it
starts fast and never competes with the server for its GIL.
"""
from __future__ import annotations

import asyncio
import json
import sys
import time

from core.inference_client import InferenceClient


async def one_round(client: InferenceClient, prompts: list[list[int]], max_new: int, timeout_s: float) -> dict:
    t0 = time.perf_counter()
    rs = await asyncio.gather(*(client.generate("", p, max_new, temperature=1.0, timeout_s=timeout_s) for p in prompts))
    return {"tokens": sum(len(r.output_ids) for r in rs), "seconds": time.perf_counter() - t0}


async def serve_jobs(address: str, timeout_s: float = 300.0) -> None:
    client = InferenceClient([address], timeout_s=timeout_s)
    loop = asyncio.get_running_loop()
    try:
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                return
            job = json.loads(line)
            res = await one_round(client, job["prompts"], int(job["max_new_tokens"]), timeout_s)
            sys.stdout.write(json.dumps(res) + "\n")
            sys.stdout.flush()
    finally:
        await client.close()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m tars.bench.front_client ADDRESS  (jobs as JSON lines on stdin)", file=sys.stderr)
        return 2
    asyncio.run(serve_jobs(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
