"""The ownership audit (docs/design.md, "The protected interval and its invariants"): record, verify, and say what holding a shard does not prove.

schema.py    the log format: records, hash chain, coordinate spaces, wire model
recorder.py  comm events + per-step holdings -> one hash-chained JSONL log per rank
inject.py    negative controls: hidden AllGather (recorded / silent), gloo's reduce_scatter
netcount.py  OS-level byte accounting from the kernel's per-socket counters (ss)
verify/      the independent verifier: reads schema + dimensions only (`fusion audit verify`)
runner.py    the experiment: N workers, cold starts, forced continuation (`fusion audit run`)
report.py    summary.json -> report.md
exposure.py  rank of what a party observes; least-squares reconstruction (`fusion audit exposure`)
attack.py    vocabulary-matching attack on a residual shard (red team)
cli.py       the `fusion audit` subcommands
"""
