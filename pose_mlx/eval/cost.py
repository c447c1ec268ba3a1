"""What an evaluation will compute, and a progress bar whose ETA follows it (`WorkBar`).

Work is counted as the floating-point operations of the forward passes (`Compute`). Feeding n new tokens to a model
whose KV cache holds p earlier ones costs

    2 n P + 2 q L (n^2 + 2 n p) + 2 r h V

with P the parameters of the blocks' linear layers, L blocks, q = heads x head_dim, h the hidden size, V the
vocabulary and r the positions whose logits are computed (all n when scoring, the last one when generating): the
products with the weights, then QK^T and PV over the keys each new token sees (p + i for the i-th: 4 q L per key),
then the output layer. A generated token is a prefill of one. Evaluations cost very unequal amounts per item (a
16k-token prompt about 6x a 4k one, and prompts that share a cached prefix less), so a bar over items would give a
wrong ETA; `WorkBar` counts this work instead, and after the first item it states the time of the whole
evaluation scaled from that item's measured seconds (on stderr, when it is more than a minute).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Callable

from tqdm import tqdm

#: Below this many estimated seconds no estimate line is printed (the bar's ETA is enough).
ESTIMATE_ABOVE_S = 60.0


@dataclass(frozen=True)
class Compute:
    """The shapes that set a forward pass's work (module docstring); `tokens_only` counts one unit per token."""

    block_parameters: int  # P
    attention: int  # q x L
    output: int  # h x V

    @classmethod
    def of(cls, arch) -> "Compute":
        """From a `pose_mlx.memory.Architecture`."""
        return cls(arch.layers * arch.parameter_counts()["block_linear"], arch.q_dims * arch.layers,
                   arch.hidden * arch.vocab)

    @classmethod
    def tokens_only(cls) -> "Compute":
        """A stand-in when the shapes are unknown (a test's oracle): the work of n new tokens is 2 n."""
        return cls(1, 0, 0)

    def prefill(self, new: int, past: int = 0, logits: int = 1) -> float:
        """FLOPs of feeding `new` tokens after `past` cached ones, with the logits of `logits` positions."""
        return 2.0 * (new * self.block_parameters + self.attention * (new * new + 2 * new * past)
                      + logits * self.output)

    def generation(self, prompt: int, kept: int, answer: int) -> float:
        """FLOPs of a prompt of `prompt` tokens whose first `kept` are cached, then `answer` greedy tokens (each one
        token after the prompt and the answer so far); the last position's logits only."""
        steps = sum(self.prefill(1, prompt + i) for i in range(answer))
        return self.prefill(prompt - kept, kept) + steps


def shared_prefix(lengths_and_depths: list[tuple], group: Callable[[int], object] = lambda i: 0) -> list[int]:
    """The tokens each prompt may take from the KV cache of the one before: prompts of one length and `group`,
    run deepest needle first, share the text before the later one's needle (about depth x length tokens); the
    first of each length or group shares nothing. Items are (length, depth)."""
    kept, previous = [], None
    for i, (length, depth) in enumerate(lengths_and_depths):
        key = (length, group(i))
        kept.append(int(depth * length) if key == previous else 0)
        previous = key
    return kept


def format_duration(seconds: float) -> str:
    """'45 s', '4 min 10 s', '2 h 5 min'."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"


class WorkBar:
    """A tqdm bar over the predicted work of `works` (one number per item, any unit), counting the items in its
    description, with an ETA that follows the work (the last item's note after it). `skip(i)` marks an item taken up from an interrupted run;
    `done(i)` one that ran. After the first that ran, when the whole evaluation is estimated above
    `ESTIMATE_ABOVE_S`, one line on stderr: the estimate, scaled from that item's measured seconds."""

    def __init__(self, prog: str, works: list[float], noun: str, show: bool = True,
                 clock: Callable[[], float] = time.perf_counter):
        self.prog, self.works, self.noun, self.clock = prog, list(works), noun, clock
        self.finished, self.work_done = 0, 0.0
        self.estimated = False  # the estimate is made once, after the first item that ran
        self.bar = tqdm(total=sum(self.works) or 1, disable=not show, file=sys.stderr,
                        desc=f"{prog} 0/{len(self.works)} {noun}s",
                        bar_format="{desc}: {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}{postfix}]")
        self._label()
        self.started = clock()

    def _label(self, note: str = "") -> None:
        self.bar.set_description_str(f"{self.prog} {self.finished}/{len(self.works)} {self.noun}s", refresh=False)
        self.bar.set_postfix_str(note, refresh=False)

    def skip(self, index: int) -> None:
        self.finished += 1
        self.work_done += self.works[index]
        self.bar.update(self.works[index])
        self._label()
        self.started = self.clock()

    def done(self, index: int, note: str = "") -> None:
        now = self.clock()
        self.finished += 1
        self.work_done += self.works[index]
        if not self.estimated and self.works[index] > 0:
            self.estimated = True
            left = (sum(self.works) - self.work_done) * (now - self.started) / self.works[index]
            if now - self.started + left > ESTIMATE_ABOVE_S:
                tqdm.write(f"{self.prog}: about {format_duration(left)} more for the other "
                           f"{len(self.works) - self.finished} {self.noun}s (the first took "
                           f"{format_duration(now - self.started)}; the others scaled by their predicted compute)",
                           file=sys.stderr)
        self.bar.update(self.works[index])
        self._label(note)

    def __enter__(self) -> "WorkBar":
        return self

    def __exit__(self, *exc) -> None:
        self.bar.close()


__all__ = ["Compute", "ESTIMATE_ABOVE_S", "WorkBar", "format_duration", "shared_prefix"]
