"""The composition of a training run: what every schedule (``rlasync.modes``) is given.

``Run`` (``run.py``) is what a schedule calls: rollouts, training batches, validation,
checkpoints, the step's record. It is made of parts, one concept a file:

- ``preflight``: every check before anything starts (the config, the rows, their tools);
- ``fleet``: where the parts run, chosen once: the cluster's nodes (``cluster_fleet``) or the
  simulator's stand-ins (``sim_fleet``);
- ``feed``: the rows, their sampler, ``data.generator``, dynamic sampling, the sampling seeds;
- ``batch``: training batches of whole groups, with their advantages;
- ``checkpoints``: what is saved when, and the checkpoint a resume starts from;
- ``record``: ``metrics.jsonl``, traces, trackers, the head's ``/metrics``;
- ``schedule``: the frame every schedule shares (its start, ``Steps``, its end).

And what they use: ``placement`` (which node runs what), ``warmstart`` and ``model_dir`` (the
model RL starts from), ``telemetry`` and ``traces``. Nothing is imported here: ``placement``
checks a config without torch (``rlasync launch``).
"""
