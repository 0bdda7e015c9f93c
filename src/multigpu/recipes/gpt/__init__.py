"""The GPT recipe: a decoder-only transformer, byte tokens of a text every Python ships, every layout.

``model.py`` the network, ``data.py`` the tokens, ``parallelize.py`` its
tensor-parallel plan and FSDP, ``train.py`` the training script
(``python -m multigpu.recipes.gpt``).
"""
