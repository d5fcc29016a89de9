"""The load generator of `tars bench inference`'s front figure, run as its own process (as actors are).

    python -m tars.bench.front_client ADDRESS [--unary]

Reads one JSON job per line on stdin, {"prompts": [[ids...], ...], "max_new_tokens": N}, sends every prompt at
once (InferenceClient.generate as actors call it, temperature 1, no trajectory id: calls made together are
coalesced into one GenerateBatch call; --unary: one Generate call each, as before GenerateBatch), waits for all of them and writes one JSON line back:
{"tokens": total output tokens, "seconds": wall time of the round}. Ends at EOF. Imports only the client, so it
starts fast and never competes with the server for its GIL. ClientProcess is the parent's side.
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

from core.inference_client import InferenceClient


async def one_round(client: InferenceClient, prompts: list[list[int]], max_new: int, timeout_s: float) -> dict:
    t0 = time.perf_counter()
    rs = await asyncio.gather(*(client.generate("", p, max_new, temperature=1.0, timeout_s=timeout_s) for p in prompts))
    return {"tokens": sum(len(r.output_ids) for r in rs), "seconds": time.perf_counter() - t0}


async def serve_jobs(address: str, timeout_s: float = 300.0, unary: bool = False) -> None:
    client = InferenceClient([address], timeout_s=timeout_s, coalesce=not unary)
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


class ClientProcess:
    """`async with ClientProcess(address) as c`: this module in its own process against `address`;
    `await c.rate(prompts, max_new)` runs one round there and returns its output tokens per second."""

    def __init__(self, address: str, timeout_s: float = 300.0, unary: bool = False):
        self.address, self.timeout_s, self.unary, self.proc = address, timeout_s, unary, None

    async def __aenter__(self) -> "ClientProcess":
        self.proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "tars.bench.front_client", self.address,
                                                         *(["--unary"] if self.unary else []),
                                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        return self

    async def rate(self, prompts: list[list[int]], max_new: int) -> float:
        self.proc.stdin.write((json.dumps({"prompts": prompts, "max_new_tokens": max_new}) + "\n").encode())
        await self.proc.stdin.drain()
        line = await asyncio.wait_for(self.proc.stdout.readline(), self.timeout_s)
        if not line:
            raise RuntimeError(f"the bench's client process ended (exit {await self.proc.wait()})")
        r = json.loads(line)
        return r["tokens"] / r["seconds"]

    async def __aexit__(self, *exc) -> None:
        self.proc.stdin.close()  # EOF: the client ends
        try:
            await asyncio.wait_for(self.proc.wait(), 10)
        except asyncio.TimeoutError:
            self.proc.kill()
            await self.proc.wait()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    unary = "--unary" in argv
    argv = [a for a in argv if a != "--unary"]
    if len(argv) != 1:
        print("usage: python -m tars.bench.front_client ADDRESS [--unary]  (jobs as JSON lines on stdin)", file=sys.stderr)
        return 2
    asyncio.run(serve_jobs(argv[0], unary=unary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
