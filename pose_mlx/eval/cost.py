"""What an evaluation will compute, and a progress bar whose ETA follows it (`WorkBar`).

Work is counted as the floating-point operations of the forward passes (`Compute`). Feeding n new tokens to a model
whose KV cache holds p earlier ones costs

    2 n P + 2 q L (n^2 + 2 n p) + 2 r h V

with P the parameters of the blocks' linear layers, L blocks, q = heads x head_dim, h the hidden size, V the
vocabulary and r the positions whose logits are computed (all n when scoring, the last one when generating): the
products with the weights, then QK^T and PV over the keys each new token sees (p + i for the i-th: 4 q L per key),
then the output layer. A generated token is a prefill of one. Evaluations cost very unequal amounts per item (a
16k-token prompt about 6x a 4k one, and prompts that share a cached prefix less), so a bar over items would give a
wrong ETA; `WorkBar` counts this work instead, within an item too (a long prompt's prefill moves it chunk by chunk,
so one 16k-token trial shows its progress and ETA within seconds), and once some seconds of work are measured it
states the time of the whole evaluation scaled from them (on stderr, when it is more than a minute).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Callable

from tqdm import tqdm

from ..words import counted

#: Below this many estimated seconds no estimate line is printed (the bar's ETA is enough).
ESTIMATE_ABOVE_S = 60.0
#: The estimate line waits for this many seconds of measured work (or the first item's end): a first chunk alone
#: also holds the warm-up.
ESTIMATE_AFTER_S = 10.0


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
    description, with an ETA that follows the work (the item's note after it). `skip(i)` marks an item taken up
    from an interrupted run; `within(i, share)` the share of item i's work done so far (a long prompt's prefill
    moves the bar chunk by chunk: `reading`); `done(i)` an item that ran. Once ESTIMATE_AFTER_S seconds of work
    are measured (or the first item ran), when the whole evaluation is estimated above `ESTIMATE_ABOVE_S`, one line
    on stderr: the time left and the whole, scaled from the work measured by the predicted work."""

    def __init__(self, prog: str, works: list[float], noun: str, show: bool = True,
                 clock: Callable[[], float] = time.perf_counter):
        self.prog, self.works, self.noun, self.clock = prog, list(works), noun, clock
        self.finished, self.skipped = 0, 0
        self.work_done, self.partial = 0.0, 0.0  # partial: the work done of the item in progress
        self.estimated = False  # the estimate is made once
        self.bar = tqdm(total=sum(self.works) or 1, disable=not show, file=sys.stderr,
                        desc=f"{prog} 0/{counted(len(self.works), noun)}",
                        bar_format="{desc}: {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}{postfix}]")
        self._label()
        self.started, self.taken_up = clock(), 0.0  # the estimate counts the work measured since `started`

    def _label(self, note: str = "") -> None:
        self.bar.set_description_str(f"{self.prog} {self.finished}/{counted(len(self.works), self.noun)}",
                                     refresh=False)
        self.bar.set_postfix_str(note, refresh=False)

    def _move(self, note: str) -> None:
        self._label(note)
        self.bar.update(max(0.0, self.work_done + self.partial - self.bar.n))

    def skip(self, index: int) -> None:
        self.finished, self.skipped = self.finished + 1, self.skipped + 1
        self.work_done += self.works[index]
        self._move("")
        self.started, self.taken_up = self.clock(), self.work_done

    def within(self, index: int, share: float, note: str = "") -> None:
        self.partial = min(max(share, 0.0), 1.0) * self.works[index]
        self._move(note)
        self._estimate(False)

    def done(self, index: int, note: str = "") -> None:
        self.finished += 1
        self.work_done, self.partial = self.work_done + self.works[index], 0.0
        self._move(note)
        self._estimate(True)

    def reading(self, index: int, compute: Compute, prompt: int, label: str, answer: int = 0,
                all_logits: bool = False) -> Callable[[int, int], None]:
        """The `progress(fed, new)` callback of item `index`'s prefill (`longctx.prefill`): a prompt of `prompt`
        tokens whose last `new` are fed (the others cached), then `answer` generated tokens (the last position's
        logits), or with `all_logits` every position's (scoring). It moves the bar by the share of the item's
        predicted work done and notes the tokens read ("16384 tokens: 3,584/16,384 read")."""
        def fed(done: int, new: int) -> None:
            kept = prompt - new
            whole = compute.prefill(new, kept, new) if all_logits else compute.generation(prompt, kept, answer)
            part = compute.prefill(done, kept, done if all_logits else 1) if done else 0.0
            self.within(index, part / whole if whole else 0.0, f"{label}: {kept + done:,}/{prompt:,} read")
        return fed

    def _estimate(self, item_done: bool) -> None:
        elapsed, measured = self.clock() - self.started, self.work_done + self.partial - self.taken_up
        if self.estimated or measured <= 0 or not (item_done or elapsed >= ESTIMATE_AFTER_S):
            return
        self.estimated = True
        whole = sum(self.works) - self.taken_up
        left = (whole - measured) * elapsed / measured
        if left >= 1 and elapsed + left > ESTIMATE_ABOVE_S:
            items, share = counted(len(self.works) - self.skipped, self.noun), measured / whole
            tqdm.write(f"{self.prog}: about {format_duration(left)} more, {format_duration(elapsed + left)} in all "
                       f"for {items} (the first {f'{share:.0%}' if share >= 0.01 else 'under 1%'} of the predicted "
                       f"work took {format_duration(elapsed)}; the rest scaled by its predicted compute)",
                       file=sys.stderr)

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> "WorkBar":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["Compute", "ESTIMATE_ABOVE_S", "ESTIMATE_AFTER_S", "WorkBar", "format_duration", "shared_prefix"]
