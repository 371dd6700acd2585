"""The acceptance harness: the source document's launch matrix as one command (`replaykv accept`).

A contract (YAML, :mod:`replaykv.accept.contract`) freezes the matrix, the metrics and the pass
criteria; the harness runs every prompt through four cache states in a baseline arm (replay
off) and a candidate arm (the switches of the contract's rollout stage), in this process or
against two OpenAI-compatible endpoints, and writes a report whose verdict is the exit code.

    contract.py  the contract file        cases.py     matrix -> prompts and cut points
    targets.py   in-process / endpoint    run.py       the quality and load passes
    stats.py     bootstrap, McNemar, KL   criteria.py  metrics, tables, verdicts
    report.py    JSON, Markdown, HTML     harness.py   one run end to end;  cli.py  the command
    pictures.py  generated images for the image-and-text suffix

Uses the engine's public API only; the engine imports nothing from here.
"""
