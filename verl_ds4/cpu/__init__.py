"""The CPU jobs: verl's own trainers on machines without an accelerator.

* :mod:`.platform`: the verl platform ``cpu`` (``VERL_PLATFORM=cpu``): gloo, ``current_device()="cpu"``.
* :mod:`.engine`: CPU Megatron engines (LM head, value head) over verl-ds4's DS4 engines, registered
  for ``device="cpu"``, and the registry of CPU model builders by HF ``model_type``.
* :mod:`.ds4_builder` (``deepseek_v4``: the full tiny DS4, or the proxy) and :mod:`.tiny_dense` (``llama``: the
  dense stepping stone): CPU model builders, selected with verl's ``model.external_lib``.
* :mod:`.sft_data`, :mod:`.ds4_tokenizer`: download-free data, tokenizer and model-folder writers.
* :mod:`.sft_to_hf`: the SFT -> RL hand-over, the SFT job's Megatron dist-checkpoint -> an HF DS4 folder.
* :mod:`.sft_run`, :mod:`.value_forward`: launch helpers for the SFT main job and the critic path
  (:mod:`.training_worker`: verl's ``TrainingWorker`` on the CPU engine, composed as verl does);
  :mod:`.console`: the launchers' quiet console (progress, summary, loss plot; full log to a file).
* :mod:`.engine_config`, :mod:`verl_ds4.substitutes.cuda_literals`, :mod:`.rng`, :mod:`.builders`, :mod:`.optimizer_state`,
  :mod:`.progress`: the CPU engine's pieces, one job each (see :mod:`.engine`).

Nothing here is imported by the layers below (layout, mcore, engine, models). ``verl-ds4 verify`` is not a CPU job:
it lives in :mod:`verl_ds4.verify` (floor 6) and reads the tiny models' configs from here.
"""
