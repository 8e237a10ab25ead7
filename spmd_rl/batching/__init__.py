"""How a step's data is laid out on the ranks: the rollout batch and its micro-batches (batch), packed
rows for variable-length attention (packing), rows moved between ranks to even their tokens
(rank_balance), and sequences shared by a Ulysses group (sequence_parallel)."""
