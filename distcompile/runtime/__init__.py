"""Runtime: the wrapped module and the gradient synchronization of a training step.

May import ``compile``, ``capture``, ``planning`` and the leaves. It never imports
``telemetry`` (TensorBoard, matplotlib): telemetry observes it through ``stats.StepObserver``.

- ``module.py``: the module users train.
- ``model_build.py``: what it runs on (reducer, backend, compiled code), built at ``wrap``,
  built again after a change, released at ``close``; its copies and pickles.
- ``model_watch.py``: parameters and buffers that change after ``wrap`` (replaced, unfrozen,
  materialized from the meta device), found and agreed across ranks.
- ``ddp.py``: adopting the DDP model's options, checked across ranks.
- ``ddp_api.py``: DDP's own API on it (communication hooks, ``Join``, the rest).
- ``nesting.py``: data-parallel wrappers in the wrong place, as errors.
- ``reducer.py``: the bucketed all-reduce of a synchronized step.
- ``layout.py``: which buckets a step's gradients travel in (frozen or not), cached.
- ``schedule.py``: a step's buckets in launch order, from the graphs that ran.
- ``bucket.py``: one flat bucket: buffer, used flags, launch, write.
- ``comm_errors.py``: a failed collective in words, the peers behind it, NaN/Inf after it.
- ``row_buckets.py``: an embedding table reduced by the rows looked up.
- ``sparse.py``: sparse gradients, reduced apart.
- ``shared_weights.py``: the parts of shared parameters, on the reducer's side.
- ``writeback.py``: reduced gradients waited for and written back, in launch order (an object
  the reducer holds).
- ``graph_memory.py``: no ``.grad`` left in CUDA-graph memory.
- ``hooks.py``: DDP communication hooks on distcompile's buckets, the reducer's hook chain
  (one bucket's hook at a time) and the hook-versus-compression rule.
- ``join.py``: uneven inputs, a joined rank shadowing the others' collectives (``JoinState``:
  the ranks still training, the last step's buckets).
- ``optim_in_backward.py``: optimizers stepped inside backward.
- ``attached_optimizer.py``: a user's optimizer stepped bucket by bucket, under communication.
- ``stats.py``: what the reducer reports about a step, and to whom.
- ``collectives.py``: collectives beyond the bucketed all-reduce, with public APIs.
- ``measure.py``: the link and the compute rate, for ``bucket_cap_mb="auto"``.
- ``forward_check.py``: the default first-step forward check.
- ``verify.py``: the full first-step check against eager DDP (``verify=True``).
- ``compare.py``: how far two tensors are apart, for both checks (complex ones by both parts).
- ``module_state.py``: a module's buffers, attributes and random state, kept and put back.
- ``ops_seen.py``: what a forward did (drew random numbers, computed in 16 bits), for both checks.
- ``grad_sources.py``: what one forward's autograd graph sends each parameter, apart from
  the loop's other uses of it (both checks).
- ``checkpoint.py``: atomic training checkpoints.
- ``shutdown.py``: process exit, models closed, communication threads finished first.
"""
