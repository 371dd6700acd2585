"""What replay costs in answers: per-token fidelity of the replay paths against the exact path
(:mod:`replaykv.fidelity.traces`), over held-out prompts, cut offsets and context lengths
(:mod:`replaykv.fidelity.study`), written as JSON, tables and plots
(:mod:`replaykv.fidelity.report`); `replaykv fidelity` runs it."""
