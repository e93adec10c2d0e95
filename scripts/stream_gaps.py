#!/usr/bin/env python3
"""Streams one long greedy /generate request and reports the gaps between SSE frames: how long
generation stood still (e.g. while a weight update commits). For docs/performance.md.

    python3 scripts/stream_gaps.py http://127.0.0.1:32001 30   # read for 30 s
"""

import json
import sys
import time
import urllib.request


def main() -> None:
    url, seconds = sys.argv[1], float(sys.argv[2])
    body = {
        "input_ids": [1, 2, 3],
        "sampling_params": {"max_new_tokens": 4000, "temperature": 0, "ignore_eos": True},
        "stream": True,
    }
    times, versions = [], []
    start = time.time()
    req = urllib.request.Request(
        url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req) as r:
        for line in r:
            line = line.rstrip(b"\r\n")
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            times.append(time.time())
            versions.append(json.loads(line[6:])["meta_info"].get("weight_version"))
            if time.time() - start > seconds:
                break
    if len(times) < 2:
        sys.exit("fewer than two frames")
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    i = max(range(1, len(times)), key=lambda k: times[k] - times[k - 1])
    print(
        f"frames {len(times)}, median gap {gaps[len(gaps) // 2] * 1e3:.1f} ms, "
        f"max gap {gaps[-1] * 1e3:.1f} ms at frame {i} "
        f"(versions {versions[i - 1]} -> {versions[i]}), versions seen {sorted(set(versions))}"
    )


if __name__ == "__main__":
    main()
