"""What stands in for the model in the simulator: an executor of made-up tokens, and made-up beam steps.

With EOS ignored the schedule does not depend on token values, so any tokens do; these are distinct across
all sequences (a counter), so that no two sequences ever fill a block with the same content by chance, which
could make a prefix-cache hit that the real engine would not see. Beam steps are made up the same way: while
a beam search is short of its length, each step keeps `beam_width` continuations whose parents a seeded
draw picks (the best beam always, the others favouring the better ranks), so beams fork and are pruned as
in a real search; at its length every beam ends, as `pagedlab.beam_search` ends a search that ignores EOS.

# Explained in chapters/14_playground.ipynb
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field

from pagedlab.core.executor import WorkerInfo
from pagedlab.core.sched_output import BeamDecision, ModelRunnerOutput, SchedulerOutput, UpdateOutput

FIRST_MADE_UP_TOKEN = 1 << 20  # above any prompt token id of `pagedlab.sim.synthetic_workload`


class MadeUpTokens:
    """A new token id at every call, never seen before."""

    def __init__(self) -> None:
        self._ids = itertools.count(FIRST_MADE_UP_TOKEN)

    def __call__(self) -> int:
        return next(self._ids)


class MadeUpExecutor:
    """The device side of a simulation (an `Executor`, `pagedlab.core.executor`): a made-up token for every
    sequence that samples. Beam sequences get no log-probabilities: `MadeUpBeams` makes their steps up."""

    def __init__(self, info: WorkerInfo, tokens: MadeUpTokens) -> None:
        self.info = info
        self.tokens = tokens

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return ModelRunnerOutput({
            target.request_id: (self.tokens(),)
            for scheduled in scheduler_output.scheduled for target in scheduled.sampling if not target.is_beam
        })

    def shutdown(self) -> None:
        """Nothing runs elsewhere."""


@dataclass
class _Group:
    beam_width: int
    max_tokens: int  # beam steps to the end: the request's output_len, capped by the room under max_model_len
    beams: list[str]  # live beam sequence ids, best first
    ready: set[str] = field(default_factory=set)
    num_generated: int = 0


class MadeUpBeams:
    """The beam searches of a simulation: each takes a made-up beam step once all its beams are computed."""

    def __init__(self, tokens: MadeUpTokens, seed: int = 0) -> None:
        self.tokens = tokens
        self.rng = random.Random(seed)
        self.groups: dict[str, _Group] = {}

    def add(self, group_id: str, root_id: str, beam_width: int, max_tokens: int) -> None:
        self.groups[group_id] = _Group(beam_width, max_tokens, [root_id])

    def step(self, output: SchedulerOutput, runner_output: ModelRunnerOutput | None = None) -> list[BeamDecision]:
        """The beam steps of the groups whose every beam got its next-token distribution in this step."""
        for group_id, root_id in output.restarted:  # a recompute preemption sent it back to its prompt
            group = self.groups[group_id]
            group.beams, group.ready, group.num_generated = [root_id], set(), 0
        for group_id, _ in output.failed:
            self.groups.pop(group_id, None)
        ready = []
        for s in output.scheduled:
            group = self.groups.get(s.group_id)
            for target in s.sampling:
                if target.is_beam and group is not None:
                    group.ready.add(target.request_id)
                    if group.ready >= set(group.beams) and s.group_id not in ready:
                        ready.append(s.group_id)
        return [self._decide(group_id) for group_id in ready]

    def _decide(self, group_id: str) -> BeamDecision:
        group = self.groups[group_id]
        group.ready.clear()
        group.num_generated += 1
        if group.num_generated >= group.max_tokens:  # every continuation ends: the search is done
            return BeamDecision(group_id, (), tuple(group.beams))
        beams = group.beams
        weights = [1 / (rank + 1) for rank in range(len(beams))]
        parents = [0] + self.rng.choices(range(len(beams)), weights, k=group.beam_width - 1)
        continuations = tuple((beams[rank], self.tokens()) for rank in sorted(parents))
        chosen = {beams[rank] for rank in parents}
        return BeamDecision(group_id, continuations, tuple(b for b in beams if b not in chosen))

    def commit(self, update: UpdateOutput) -> None:
        """The scheduler applied the beam steps: `update.beam_ids` names the sequence of each new beam."""
        for group_id, beam_ids in update.beam_ids:
            if beam_ids:
                self.groups[group_id].beams = list(beam_ids)
            else:
                del self.groups[group_id]
        for group_id, _ in update.failed:
            self.groups.pop(group_id, None)
