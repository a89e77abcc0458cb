"""A progress bar for work counted in items (prompts) whose speed is counted in tokens."""
from __future__ import annotations

import time


class TokenRate:
    """A progress bar over the prompts being sampled that shows the tokens sampled per second and
    so far (it moves at every decoding step, not only when a chunk of prompts ends); a no-op
    without a label."""
    EVERY_S = 0.5  # at most two redraws a second

    def __init__(self, label: str | None, prompts: int, G: int):
        self.bar, self.n, self.t0, self.shown = None, 0, time.perf_counter(), 0.0
        if label:
            from tqdm.auto import tqdm
            self.bar = tqdm(total=prompts, desc=label, unit="prompt", leave=False)
            self.bar.set_postfix_str(f"G={G}", refresh=False)

    def tokens(self, n: int) -> None:
        self.n += n
        now = time.perf_counter()
        if self.bar is not None and now - self.shown >= self.EVERY_S:
            self.shown = now
            rate = self.n / max(now - self.t0, 1e-9)
            self.bar.set_postfix_str(f"{self.n} tokens, {rate:.0f} tok/s")  # redraws

    def prompts(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
