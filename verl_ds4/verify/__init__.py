"""``verl-ds4 verify``: prove that the project's models compute what they should.

* :mod:`.parity`: the CP parity harness of the tiny DS4 (``--model ds4`` / ``ds4_proxy``): CP = N against
  CP = 1, on CPU (gloo ranks) or on GPUs (``--device cuda``: nccl ranks, against the fp64 CPU reference),
  with its negative controls; :mod:`.cli` the command.
* :mod:`.ds41` (+ :mod:`.ds41_dspark`): ``--model ds41 --cp N``, V4.1 against CP = 1 and NeMo Automodel.
* :mod:`.hf` and :mod:`.ds41_hf`: ``--hf-checkpoint DIR``, our model from an HF folder against transformers
  (DS4) or NeMo Automodel (V4.1).

Verification is not a CPU job: this package runs on a GPU machine without verl (it never imports verl or
Ray); it reads the tiny models' configs from :mod:`verl_ds4.cpu` (floor 5).
"""
