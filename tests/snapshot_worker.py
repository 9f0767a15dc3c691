"""Runs a FakeModel engine with a snapshot after every step until killed
(tests/test_snapshot.py kills it with SIGKILL and restores the last snapshot)."""

import os
import sys

from kvtier_jax.serving import snapshot
from tests import test_snapshot


def main(directory: str, seed: int) -> None:
  # Its disk tier under the test's directory: a SIGKILLed engine cleans up nothing.
  engine, schedule = test_snapshot.build(seed, os.path.join(directory, "worker-disk"))
  while True:
    test_snapshot.feed(engine, schedule)
    if not engine.has_work and engine.steps > max(schedule, default=0):
      break
    engine.step()
    snapshot.save(engine, os.path.join(directory, f"step-{engine.steps:05d}"))
    print(engine.steps, flush=True)


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]))
