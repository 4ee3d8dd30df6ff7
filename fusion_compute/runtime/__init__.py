"""A job on the client's side, common to both modes: options and their checks, the engine (start-up,
links, epochs, close), membership changes (recovery, revocation, standbys), the per-step deadline and
whom the evidence blames (deadline.py, blame.py), local worker processes and this process's
resources (launch.py, resources.py), topology files, fault injection for the tests, start-up
progress.

May import: model, weights, comm, executor, errors. Never structural, masked, generation, serving or cli."""
