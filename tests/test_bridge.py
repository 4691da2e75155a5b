"""The native thread ↔ hub bridge, in a monkey-patched subprocess as under gunicorn."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    from gevent import monkey; monkey.patch_all()
    import json, time, gevent
    from gevent.monkey import get_original
    from wsgi_infer.server.engine_client.bridge import HubBridge

    native_sleep = get_original("time", "sleep")

    received, ticks = [], []
    bridge = HubBridge(received.extend)

    def producer():  # a genuine OS thread: 20,000 items in bursts of 100, like engine steps
        assert list(bridge.commands(block=True)) == ["go"]
        for burst in range(200):
            bridge.post(list(range(burst * 100, (burst + 1) * 100)))
            native_sleep(0.001)
        bridge.post(["end"])

    def ticker():  # proves the hub keeps running while items pour in
        while not received or received[-1] != "end":
            ticks.append(time.monotonic())
            gevent.sleep(0.001)

    bridge.start_thread(producer)
    tick = gevent.spawn(ticker)
    bridge.send("go")
    tick.join(timeout=30)
    gaps = [b - a for a, b in zip(ticks, ticks[1:])]
    print(json.dumps({"received": received[:-1], "max_gap": max(gaps, default=0.0), "ticks": len(ticks)}))
    """
)


def test_every_item_arrives_in_order_and_the_hub_keeps_running():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["received"] == list(range(20_000))
    assert result["ticks"] >= 20
    assert result["max_gap"] < 0.5  # a blocked hub would show one long gap
