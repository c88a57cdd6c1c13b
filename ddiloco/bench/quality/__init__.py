"""Training quality: Decoupled DiLoCo vs synchronous DiLoCo vs data-parallel, at equal tokens.

Every run trains the same model from the same seed on the same learner shards, and stops when
the learners together have trained the same number of tokens (M learners x ``steps`` x batch x
sequence). The DiLoCo regimes all go through :func:`ddiloco.inprocess.run_inprocess` (the real
learner, ledger, store and synchronizer on a simulated clock; a learner step takes 1 simulated
second at full speed); data-parallel is a plain loop (M replicas' gradients averaged every step).

Rows (``regime``):

* ``data_parallel``: M replicas, gradients averaged every step (one model, M micro-batches).
* ``diloco``: synchronous DiLoCo: P = 1, every H steps, overlap 0, quorum M, plain mean, equal
  weights, no compression, overwrite, outer lr 0.7 (the exact-reduction and paper settings).
* ``streaming_diloco``: the same with P fragments, each every H steps (staggered).
* ``decoupled``: the run defaults (K = 1, adaptive grace, token weights, RDA, blend 0.5 on
  receipt, outer lr 0.5, int8, overlap 2).
* ``decoupled_stragglers``: the same with learner speeds 1, 0.5, 0.667, 1.
* ``decoupled_failures``: the same with a seeded outage schedule taking ~25% of learner-time.
* ablations and the sweep: the decoupled (or stragglers, outages) row with one knob changed;
  ``m8_*``: M = 8 learners at the same tokens; ``ablation_rebase*`` and ``m8_rebase``:
  ``merge.on_receipt: rebase`` against the default blend, on every model.

Goodput (in-process) = tokens merged into the global model / tokens the learners could have
trained in the learner-time allocated to the run (each learner at its own speed, over the whole
simulated span, down or not).

Modules, one job each: :mod:`.plan` (rows, configs, outages, goals), :mod:`.run` (training a row
and profiling it through the code's timing spans), :mod:`.report` (goals, notes, tables, the docs
block), :mod:`.output` (where files go, plots); ``ddiloco bench quality`` (``bench/command.py``)
strings them together."""
