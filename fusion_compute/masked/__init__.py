"""Masked mode: workers compute on one-time-pad-masked data in the ring Z/2^64 (docs/masked.md).

Groups: A multiplies masked inputs; k >= 1 mask groups (named B when k = 1, else B1..Bk) each
multiply their own mask stream. The client checks every product the workers return (verify.py) and
removes a worker caught returning a wrong one.

  ring.py      fixed-point encode/decode; exact ring matrix product by float64 limbs; overflow bounds
  masks.py     the per-session ChaCha20 mask streams shared by the client and each mask group
  plan.py      group A and the k mask groups, and each member's output rows of every linear, as data
  protocol.py  control words and message kinds
  worker.py    group A (W_fx (x_fx + Σ r_i)) and mask group i (W_fx r_i, one step ahead)
  member.py    a masked worker process after joining: which member it plays, its log, its loop
  controls.py  the dishonest members (lying, leaking) tests and the audit choose at start-up
  client.py    MaskedEngine: the nonlinear steps and the KV cache in the clear, on the user side
  verify.py    the client's check of every product (Freivalds, over the integers) and who to blame
  audit.py     per-rank logs, A's tap, the verifier and the exposure report
  attack.py    the vocabulary-matching attack on a captured view
  bench.py     measured costs against the structural mode
  options.py   `--mode masked` group sizes: `--workers A+B` or `A+B1+...+Bk`, or a topology's groups

The structural mode's own code does not import anything from here; only the dispatch on --mode masked
(cli.py, options.py, worker.py, gateway.py) loads this package.
"""
