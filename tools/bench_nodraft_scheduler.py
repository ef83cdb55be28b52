"""vLLM's scheduler, less the decode-step drafts of the `extract_hidden_states` method.

That method's proposer returns each step's sampled token as the next step's draft, so
every decode step of a generation verifies two tokens per sequence and keeps one (the
draft is the previous token again, and is almost always rejected). Capture never needs
those drafts: the states are written while the prompt is prefilled. This scheduler drops
them, so a generation decodes one token per step as on a plain engine.

A measurement aid for bench/regen_spec_cost.py (its "nodraft" arm), loaded by vLLM's
engine process through `scheduler_cls`; not used by hsx serve.
"""

from __future__ import annotations

from vllm.v1.core.sched.scheduler import Scheduler


class NoDraftScheduler(Scheduler):
    def update_draft_token_ids(self, draft_token_ids) -> None:
        return None  # requests keep spec_token_ids == []: nothing to verify next step

    def update_draft_token_ids_in_output(self, draft_token_ids, scheduler_output) -> None:
        return None
