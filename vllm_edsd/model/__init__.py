"""The drafters in plain PyTorch, the one definition of each architecture: the EDSD draft model
(``edsd``) and the EAGLE-3 baseline (``eagle3``). Training, conversion and the parity tests use
them; ``serving/vllm_model.py`` mirrors ``edsd`` with vLLM's layers. Nothing here imports vLLM."""
