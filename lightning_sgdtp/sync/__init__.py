"""Gradient synchronisation outside and around the compiled graphs: every gradient reduced exactly once per optimizer
step (:class:`~lightning_sgdtp.sync.grad_sync.GradSync`, its ledger, and the collectives under the fault guard)."""
