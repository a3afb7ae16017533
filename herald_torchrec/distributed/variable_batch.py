"""Variable batch per feature (VBE) inputs, expanded to one bag per sample so Herald can schedule them.

A VBE KeyedJaggedTensor holds, per feature, only the distinct bags of the batch (`stride_per_key()` of them, e.g. one
user bag for the many candidate items of a request) plus `inverse_indices`: for each feature, the bag each of the B
samples reads. TorchRec's EmbeddingBagCollection pools the distinct bags and then selects rows of the pooled output
by `inverse_indices`, so sample i's embedding is its bag's. Expanding the KJT first (sample i gets a copy of its bag)
gives the same pooled output, and the same gradient on every row: each copy contributes the gradient of its sample,
whose sum over a bag's copies is what the selected pooled bag receives. Only the summation order differs.

Herald assigns samples, not bags, to ranks, so it needs one bag per sample: the input stage and the sharded module
call `expand_variable_batch` on a VBE input. A VBE KJT without `inverse_indices` cannot be mapped to samples (the
EBC cannot pool it either) and is refused.

Worked example (feature `u` deduplicated to 2 bags for 3 samples, `i` with one bag per sample):

    keys ["u", "i"], stride_per_key_per_rank [[2], [3]], lengths [2, 1 | 1, 1, 1]
    values [7, 8, 9 | 4, 5, 6], inverse_indices (["u", "i"], [[0, 1, 0], [0, 1, 2]])
    -> keys ["u", "i"], stride 3, lengths [2, 1, 2 | 1, 1, 1], values [7, 8, 9, 7, 8 | 4, 5, 6]
"""

from __future__ import annotations

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


def expand_variable_batch(kjt: KeyedJaggedTensor, where: str = "Herald") -> KeyedJaggedTensor:
    """`kjt` with one bag per sample (itself when it is not VBE); ValueError for a VBE KJT Herald cannot expand."""
    if not kjt.variable_stride_per_key():
        return kjt
    inverse = kjt.inverse_indices_or_none()
    if inverse is None:
        raise ValueError(
            f"{where}: a KeyedJaggedTensor with a variable batch size per feature (stride_per_key_per_rank) needs "
            "inverse_indices (the bag of each sample, per feature) to be scheduled sample by sample"
        )
    inverse_keys, inverse_index = inverse
    keys = kjt.keys()
    position = {k: i for i, k in enumerate(inverse_keys)}
    missing = [k for k in keys if k.split("@")[0] not in position]  # TorchRec's naming for feature variants
    if missing:
        raise ValueError(f"{where}: the VBE KeyedJaggedTensor's inverse_indices lack the features {missing}")
    strides = torch.tensor(kjt.stride_per_key(), dtype=torch.int64)
    lengths = kjt.lengths().to(torch.int64)
    if int(strides.sum()) != lengths.numel():
        raise ValueError(f"{where}: VBE KJT: {lengths.numel()} lengths for {int(strides.sum())} bags")
    rows = torch.tensor([position[k.split("@")[0]] for k in keys], dtype=torch.int64, device=inverse_index.device)
    chosen = inverse_index.index_select(0, rows).to(torch.int64).cpu()  # [F, B]: bag of each sample, per feature
    if chosen.numel() and bool(((chosen < 0) | (chosen >= strides.unsqueeze(1))).any()):
        raise ValueError(f"{where}: VBE KJT: inverse_indices address bags beyond stride_per_key {strides.tolist()}")
    first_bag = torch.cumsum(strides, 0) - strides  # each feature's first bag among all bags
    bags = (chosen + first_bag.unsqueeze(1)).reshape(-1).to(lengths.device)  # feature-major, sample-minor
    starts = torch.cumsum(lengths, 0) - lengths  # where each bag's values begin
    new_lengths = lengths.index_select(0, bags)
    new_starts = torch.cumsum(new_lengths, 0) - new_lengths
    # position of each new value in the old values: its bag's start plus its rank inside the bag
    index = torch.repeat_interleave(starts.index_select(0, bags) - new_starts, new_lengths) + torch.arange(
        int(new_lengths.sum()), dtype=torch.int64, device=lengths.device
    )
    values = kjt.values().index_select(0, index.to(kjt.values().device))
    weights = kjt.weights_or_none()
    return KeyedJaggedTensor(
        keys=keys,
        values=values,
        weights=None if weights is None else weights.index_select(0, index.to(weights.device)),
        lengths=new_lengths.to(kjt.lengths().dtype),
        stride=int(chosen.shape[1]),
    )
