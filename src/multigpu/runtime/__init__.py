"""The runtime's shared pieces below every other layer (docs/architecture.md).

``contract.py`` is the launcher -> worker contract of ``multigpu run``. It sits here, not in
``launch/``, because every worker reads it (the process group, the meter, the finder, the
recipes): importing it must not import the launcher above them.
"""
