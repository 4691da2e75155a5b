#!/usr/bin/env python
"""How fast an idle engine thread wakes, and how fast its output reaches the hub.

In a gevent-patched process, as under gunicorn: the native thread sleeps on
the HubBridge's command queue, as the engine thread does while idle; the hub
sends a timestamp, the thread measures the wake-up and posts back through the
bridge; the hub measures the delivery. Example:

    .venv/bin/python scripts/bench_wakeup.py --samples 500
"""

from gevent import monkey

monkey.patch_all()

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import gevent.event  # noqa: E402

from wsgi_infer.server.engine_client.bridge import HubBridge  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=500)
    args = parser.parse_args()
    wakeups, deliveries = [], []
    arrived = gevent.event.Event()

    def on_delivery(sent_back: float) -> None:
        deliveries.append(time.perf_counter() - sent_back)
        arrived.set()

    bridge = HubBridge(on_delivery)

    def engine_thread() -> None:
        while True:
            for sent in bridge.commands(block=True):
                if sent is None:
                    return
                wakeups.append(time.perf_counter() - sent)
                bridge.post(time.perf_counter())

    bridge.start_thread(engine_thread)
    for _ in range(args.samples):
        gevent.sleep(0.002)  # let the thread fall asleep again
        arrived.clear()
        bridge.send(time.perf_counter())
        arrived.wait(5)
    bridge.send(None)
    for name, values in (("idle thread wake-up", wakeups), ("thread → hub delivery", deliveries)):
        ordered = sorted(values)
        p99 = ordered[int(0.99 * (len(ordered) - 1))]
        print(f"{name}: p50 {1e6 * statistics.median(values):.0f} µs, p99 {1e6 * p99:.0f} µs ({len(values)} samples)")


if __name__ == "__main__":
    main()
