"""Variable batch per feature (VBE) inputs: expanded to one bag per sample, they pool and train as TorchRec's own
EmbeddingBagCollection pools and trains the VBE KJT (which selects pooled bags by `inverse_indices`)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.test_embeddingbag import make_ebc, make_module


def vbe_kjt(weighted: bool = False):
    """f0 deduplicated to 2 bags for 4 samples (a request's user), f1 one bag per sample."""
    from torchrec import KeyedJaggedTensor

    values = torch.tensor([1, 19, 3, 0, 32, 5, 7], dtype=torch.int64)  # f0: [1, 19] [3]; f1: [0] [] [32, 5] [7]
    return KeyedJaggedTensor(
        keys=["f0", "f1"],
        values=values,
        lengths=torch.tensor([2, 1, 1, 0, 2, 1], dtype=torch.int64),
        weights=torch.tensor([0.5, 2.0, 3.0, 1.5, 0.25, 4.0, 1.0]) if weighted else None,
        stride_per_key_per_rank=[[2], [4]],
        inverse_indices=(["f0", "f1"], torch.tensor([[0, 1, 1, 0], [0, 1, 2, 3]])),
    )


def test_expansion_gives_each_sample_its_bag() -> None:
    from herald_torchrec.distributed.variable_batch import expand_variable_batch

    e = expand_variable_batch(vbe_kjt(weighted=True))
    assert not e.variable_stride_per_key() and e.stride() == 4
    assert e.lengths().tolist() == [2, 1, 1, 2, 1, 0, 2, 1]
    assert e.values().tolist() == [1, 19, 3, 3, 1, 19, 0, 32, 5, 7]
    assert e.weights().tolist() == [0.5, 2.0, 3.0, 3.0, 0.5, 2.0, 1.5, 0.25, 4.0, 1.0]
    assert expand_variable_batch(e) is e  # a KJT that is not VBE is returned as it is


@pytest.mark.parametrize("weighted", [False, True])
def test_expanded_input_pools_and_backpropagates_like_the_vbe_input(weighted: bool) -> None:
    from herald_torchrec.distributed.variable_batch import expand_variable_batch

    ebc = make_ebc(weighted=weighted)
    width = sum(c.embedding_dim for c in ebc.embedding_bag_configs())
    upstream = torch.randn(4, width, generator=torch.Generator().manual_seed(1))
    grads = []
    for x in (vbe_kjt(weighted), expand_variable_batch(vbe_kjt(weighted))):
        ebc.zero_grad()
        out = ebc(x).values()
        (out * upstream).sum().backward()
        grads.append((out.detach(), [p.grad.clone() for p in ebc.parameters()]))
    (out_vbe, g_vbe), (out_exp, g_exp) = grads
    assert out_vbe.shape == out_exp.shape == upstream.shape
    assert torch.allclose(out_vbe, out_exp, atol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(g_vbe, g_exp))
    assert max(float(g.abs().max()) for g in g_vbe) > 0


def test_one_rank_herald_module_trains_a_vbe_input_like_the_unsharded_ebc() -> None:
    ebc = make_ebc()
    ref = {n: p.detach().clone() for n, p in ebc.named_parameters()}
    m = make_module(ebc=ebc, fused_params={"optimizer": "exact_sgd", "learning_rate": 0.5})
    width = sum(c.embedding_dim for c in ebc.embedding_bag_configs())
    upstream = torch.randn(4, width, generator=torch.Generator().manual_seed(2))
    for _ in range(3):
        out = m(vbe_kjt()).wait().values()
        (out * upstream).sum().backward()
    # the reference: TorchRec's EBC on the VBE KJT, plain SGD with the same rate
    ref_ebc = make_ebc()
    with torch.no_grad():
        for n, p in ref_ebc.named_parameters():
            p.copy_(ref[n])
    for _ in range(3):
        ref_ebc.zero_grad()
        (ref_ebc(vbe_kjt()).values() * upstream).sum().backward()
        with torch.no_grad():
            for p in ref_ebc.parameters():
                p -= 0.5 * p.grad
    tables, _ = m.full_tables()
    want = {n.split(".")[-2]: p.detach() for n, p in ref_ebc.named_parameters()}
    assert sorted(tables) == sorted(want)
    assert max(float((tables[t] - want[t]).abs().max()) for t in want) <= 1e-6
    assert max(float((want[t] - ref[f"embedding_bags.{t}.weight"]).abs().max()) for t in want) > 1e-3


def test_vbe_without_inverse_indices_is_refused_by_name() -> None:
    from torchrec import KeyedJaggedTensor

    x = KeyedJaggedTensor(
        keys=["f0", "f1"],
        values=torch.tensor([1, 3, 0]),
        lengths=torch.tensor([1, 1, 1]),
        stride_per_key_per_rank=[[2], [1]],
    )
    with pytest.raises(
        ValueError, match="Herald-managed EBC: .*variable batch size per feature.*needs inverse_indices"
    ):
        make_module()(x)


def test_a_vbe_batch_enters_the_input_stage_with_one_bag_per_sample() -> None:
    from torchrec.datasets.utils import Batch

    from herald_torchrec.distributed.train_pipeline.input_layout import check_batch

    got = check_batch(Batch(torch.zeros(4, 3), vbe_kjt(), torch.zeros(4))).sparse_features
    assert not got.variable_stride_per_key() and got.stride() == 4
    assert got.lengths().tolist() == [2, 1, 1, 2, 1, 0, 2, 1]
