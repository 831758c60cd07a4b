"""Child processes of the Python tests (rollout ranks, trainer ranks): their stdout read as lines of
words, and the checks of what a rank saved."""

import json
import os
import pathlib
import queue
import subprocess
import sys
import threading

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent


class Child:
    """A child process whose stdout lines are read as lists of words; `timeout_s` bounds every wait."""

    def __init__(self, argv, timeout_s, env=None):
        self.timeout_s = timeout_s
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True,
                                     env=dict(os.environ) if env is None else env)
        self.lines = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line.split())
        self.lines.put(["eof"])

    def next(self):
        return self.lines.get(timeout=self.timeout_s)

    def expect(self, *words):
        got = self.next()
        assert got == [str(w) for w in words]

    def wait(self):
        """The exit status; a child still running after the timeout is killed, and that raises."""
        try:
            return self.proc.wait(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def rollout_rank(address, rank, tp, config, out, timeout_s, *extra, env=None):
    """rollout_rank.py as rank `rank` of a TP `tp` replica of the Llama `config` (LlamaConfig fields),
    saving its arrays under `out`; `extra`: more of its arguments."""
    argv = [sys.executable, str(HERE / "rollout_rank.py"), "--coordinator", address, "--rank", str(rank), "--tp",
            str(tp), "--config", json.dumps(config), "--out", str(out), *extra]
    return Child(argv, timeout_s, env)


def check_saved_storage(path, want, what):
    """The arrays a rank saved at `path` are exactly `want` ({storage name: array}), byte for byte."""
    got = np.load(path)
    assert sorted(got.files) == sorted(want)
    for name, w in want.items():
        g = got[name]
        assert g.shape == w.shape, name
        assert g.dtype.itemsize == w.dtype.itemsize, name
        mismatch = np.flatnonzero(g.view(np.uint8) != w.view(np.uint8))
        assert mismatch.size == 0, f"{what} {name}: {mismatch.size} bytes differ, first {mismatch[:5]}"
