"""Hugging Face safetensors directories as transformers writes them: the shard size and split that
``mg.save_pretrained`` and ``multigpu ckpt export --hf`` share, and how a refusal names tensors that differ."""

from __future__ import annotations

DEFAULT_SHARD_BYTES = 5 * 1024 ** 3  # transformers' default max_shard_size


def shard_files(sizes: dict[str, int], limit: int) -> dict[str, int]:
    """Each tensor's output file (1-based), in order, from its bytes, a new file when the next tensor would pass
    ``limit`` bytes (a tensor larger than ``limit`` alone in its file), as transformers splits."""
    files, index, size = {}, 1, 0
    for name, nbytes in sizes.items():
        if size and size + nbytes > limit:
            index, size = index + 1, 0
        files[name] = index
        size += nbytes
    return files


def name_mismatch(missing: list[str], unexpected: list[str]) -> str:
    """"N of its tensors missing (a, b, c); M not its own (d, e, f)": what a refusal says of names that differ."""
    return "; ".join(x for x in (f"{len(missing)} of its tensors missing ({', '.join(missing[:3])})" if missing
                                 else "", f"{len(unexpected)} not its own ({', '.join(unexpected[:3])})"
                                 if unexpected else "") if x)
