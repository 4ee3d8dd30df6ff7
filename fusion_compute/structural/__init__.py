"""The structural mode: the plan (who owns which coordinates, as data), the sharded operators,
one worker's sharded model, the worker in three layers (runner.py: the step, transport-free;
op_loop.py: the control words over the Comm; worker.py: the process or thread shell), the client's
side of a step, the control words, and the Megatron-style baseline (the forbidden layout, for the
benchmark and the audit's negative control).

May import: model, weights, comm, errors, runtime (the client is an engine; the worker uses its
launch, progress and resources), and of audit/ only the verifier's leaf (audit/verify/drawing.py,
which picture.py shares): a worker's audit recorder is handed in at start-up
(WorkerOptions.recorder). masked/ is its sibling, which it does not import: the command line hands
the worker the masked member's runner, to serve the mode the client names. Not the test-only
controls: a worker's faults, leaks and the baseline are handed to it at start-up (controls.py;
fusion_compute/controls/), the bench's control ops too (bench/ops.py)."""
