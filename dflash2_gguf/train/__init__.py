"""Drafter training (PyTorch): the DFlash 2 module, the objective, the loop, HF export.

Needs the ``torch`` extra (torch, plus ``gguf`` and ``safetensors`` from the base install).
Submodules are imported on use so ``import dflash2_gguf.train`` stays light.
"""
