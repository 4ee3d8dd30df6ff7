"""What a worker process is made to do besides the honest protocol, chosen once at start-up: a test's
faults (runtime/faults.py), the audit's leaks (audit/inject.py) and the replicated-residual
baseline (structural/megatron.py), as one structural.controls.Controls subclass the command line
hands the worker (worker.py). The honest worker imports none of it.

May import: every package but cli and serving; only cli imports it."""
