"""The scenarios that change a fleet while it serves: one of five encoders leaving between two runs of
the same workload, the second by a fresh receiver (`membership`), and one of four made slow under two
receivers (`slow_encoder`)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections import Counter

from .modes import ModeRun
from .workloads import no_repeat_workload, zipf_workload


class Dns:
    """The membership scenario's name -> the ports it lists now."""

    def __init__(self, ports: list[int]):
        self.ports = ports

    def __call__(self, host: str, port: int) -> list[tuple[str, int]]:
        return [("127.0.0.1", p) for p in self.ports]


async def membership(fleet, extra, images_for, args) -> dict:
    """One of 5 encoders leaves between two runs of the same Zipf workload (8 in flight); the second run
    is a fresh receiver's, which knows nothing of where the first one sent what."""
    dns = Dns([p.port for p in fleet] + [extra.port])
    workload = zipf_workload(args.membership_requests, args.images, args.zipf, args.seed + 7)
    images = images_for(args.images)

    def receiver() -> ModeRun:
        return ModeRun("affinity", [["dns:///encoders.bench:50051"]], args.balance, resolver=dns, refresh_s=0.0)

    first = run = receiver()
    try:
        await run.closed_loop(list(enumerate(workload)), images, args.concurrency)
        before = {image: set(urls) for image, urls in run.served.items()}
        gone = extra.url
        dns.ports = dns.ports[:4]
        await first.close()
        run = receiver()
        await run.closed_loop(list(enumerate(workload)), images, args.concurrency)
        lived_elsewhere = [image for image, urls in before.items() if gone not in urls]
        moved = [image for image in lived_elsewhere if not run.served[image] <= before[image]]
        spread = Counter(url for image, urls in before.items() if gone in urls for url in run.served[image])
        return {
            "images": len(before),
            "lived_on_the_other_four": len(lived_elsewhere),
            "moved": len(moved),
            "moved_fraction": round(len(moved) / max(1, len(lived_elsewhere)), 4),
            "departed_images_now_on": len(spread),
        }
    finally:
        await run.close()


@contextlib.contextmanager
def slowed(pid: int, stopped_s: float = 0.03, running_s: float = 0.01):
    """Makes a process slow: stopped `stopped_s`, running `running_s`, over and over, until exit."""
    done = threading.Event()

    def cycle() -> None:
        while not done.is_set():
            os.kill(pid, signal.SIGSTOP)
            time.sleep(stopped_s)
            os.kill(pid, signal.SIGCONT)
            done.wait(running_s)

    thread = threading.Thread(target=cycle, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        os.kill(pid, signal.SIGCONT)


async def slow_encoder(fleet, images_for, args) -> dict:
    """Two receivers share 4 encoders (images never repeat); then one encoder is made slow."""
    urls = [p.url for p in fleet]
    slow = fleet[0]
    runs = [ModeRun("affinity", [urls], args.balance) for _ in range(2)]
    shares = {}
    try:
        for phase in ("before", "slowed"):
            workload = no_repeat_workload(args.slow_requests, args.seed + 11)
            images = images_for(sum(map(len, workload)))
            for run in runs:
                run.forwards_by_encoder.clear()
            numbered = list(enumerate(workload))
            halves = [numbered[0::2], numbered[1::2]]  # one half per receiver, at once
            with slowed(slow.process.pid) if phase == "slowed" else contextlib.nullcontext():
                await asyncio.gather(
                    *(run.closed_loop(half, images, args.concurrency // 2) for run, half in zip(runs, halves))
                )
            by_receiver = [
                round(run.forwards_by_encoder[slow.url] / max(1, sum(run.forwards_by_encoder.values())), 4)
                for run in runs
            ]
            total = sum(run.forwards_by_encoder[slow.url] for run in runs)
            shares[phase] = {
                "share_of_new_work": round(total / sum(sum(r.forwards_by_encoder.values()) for r in runs), 4),
                "by_receiver": by_receiver,
            }
        return shares
    finally:
        for run in runs:
            await run.close()
