"""Masked mode: workers compute on one-time-pad-masked data in the ring Z/2^64 (docs/masked.md).

  ring.py      fixed-point encode/decode; exact ring matrix product by float64 limbs; overflow bounds
  masks.py     the per-session ChaCha20 mask stream shared by the client and group B
  plan.py      the two groups and each member's output rows of every linear, as data
  protocol.py  control words and message kinds
  worker.py    group A (W_fx (x_fx + r)) and group B (W_fx r, one step ahead)
  client.py    MaskedEngine: the nonlinear steps and the KV cache in the clear, on the user side
  audit.py     per-rank logs, A's tap, the verifier and the exposure report
  attack.py    the vocabulary-matching attack on a captured view
  bench.py     measured costs against the structural mode
  cli.py       `fusion generate --mode masked --workers A+B`, `fusion worker --mode masked`

The structural mode (the rest of the package) does not import anything from here.
"""
