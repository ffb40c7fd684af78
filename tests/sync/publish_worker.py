"""Publishes versions into a root in an endless loop, to be SIGKILLed by tests/sync/test_publish.py.

    python tests/sync/publish_worker.py ROOT

Each version is three files of 200-400 KB written in 32 KB chunks with a tiny sleep between chunks,
so that a kill at a random instant often lands in the middle of a write. Prints "started" once the
publisher is built, then one line per published version.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from any directory

from graft.sync.publish import WeightPublisher  # noqa: E402

CHUNK_BYTES = 32 * 1024


def write_files(tmp: Path, version: int) -> None:
    rng = random.Random(version)
    for i in range(3):
        with open(tmp / f"shard-{i}.bin", "wb") as f:
            for _ in range(rng.randint(200, 400) * 1024 // CHUNK_BYTES):
                f.write(rng.randbytes(CHUNK_BYTES))
                time.sleep(0.0002)
    (tmp / "config.json").write_text(f'{{"version": {version}}}')


def main(root: str) -> None:
    publisher = WeightPublisher(root, keep_versions=3)
    latest = publisher.latest("adapter")
    version = 1 if latest is None else latest.version + 1
    print("started", flush=True)
    while True:
        publisher.publish("adapter", version, step=10 * version, write=lambda tmp, v=version: write_files(tmp, v))
        print("published", version, flush=True)
        version += 1


if __name__ == "__main__":
    main(sys.argv[1])
